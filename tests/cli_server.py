"""Run ``python -m titanctl ARGS`` in a fresh process without paying for Python's and torch's start
each time (about 2.2 of the 2.5 s a failing command takes on 2 cores; the suite runs a few hundred).

A server process, started once per test session, imports torch and the other heavy third-party
modules and nothing of titanctl, then forks one child per command. The child is a new process in
its own session, as the command would be: it takes the command's environment, folder, stdin,
stdout and stderr, imports titanctl (so every import-time choice of titanctl sees that environment)
and runs ``titanctl.cli.app.main`` as ``python -m titanctl`` does; its exit status is the command's.

Commands whose environments differ in a variable that Python or torch read at start (PYTHON*, LANG,
LC_*, OMP_*, ATEN_CPU_CAPABILITY, ...) get servers of their own, started with that environment; past
a few such servers, and for commands with stdin data, a command gets a real interpreter.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import locale
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tests.conftest import REPO, TITANCTL
from tests.fork_server import READ_AT_START, preload


def _serve(sock: socket.socket) -> None:
    """The server's loop: one JSON request per line, answered with the child's pid, then its status."""
    forkable = preload()
    stream = sock.makefile("rwb", buffering=0)
    stream.write(json.dumps({"forkable": forkable}).encode() + b"\n")
    for line in stream:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            stream.close()
            sock.close()
            _child(request)  # never returns
        stream.write(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        stream.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


def _child(request: dict) -> None:
    code = 1
    try:
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, (path, mode) in enumerate(((request["stdin"], os.O_RDONLY), (request["stdout"], os.O_WRONLY),
                                           (request["stderr"], os.O_WRONLY))):
            opened = os.open(path, mode)
            os.dup2(opened, fd)
            os.close(opened)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        sys.argv = [str(REPO / "titanctl" / "__main__.py"), *request["args"]]
        sys.path[0] = request["cwd"]  # as `python -m` puts the working folder first
        from titanctl.cli.app import main

        main(request["args"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code)


class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair()
        self.env = env
        # torch imports numpy, whose OpenBLAS starts a thread pool unless told to stay single-threaded:
        # the server must have one thread to fork (titanctl's numpy does no BLAS work).
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"import socket, sys; sys.path.insert(0, {str(REPO)!r}); "
             "from tests.cli_server import _serve; _serve(socket.socket(fileno=int(sys.argv[1])))",
             str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env={**self.env, "OPENBLAS_NUM_THREADS": "1"}, cwd=REPO,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock, self.pending = ours, b""
        self.lock = threading.Lock()  # one command at a time (tests may call from threads)
        self.forkable = self._answer(timeout=120)["forkable"]
        atexit.register(self.close)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def _answer(self, timeout: float | None) -> dict:
        """The server's next line (TimeoutError past ``timeout``; what was read so far is kept)."""
        self.sock.settimeout(timeout)
        while b"\n" not in self.pending:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise RuntimeError("the titanctl CLI server ended")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def serves(self) -> bool:
        return self.forkable and self.proc.poll() is None

    def run(self, args: list[str], env: dict[str, str], cwd: str, timeout: float | None) -> tuple[int, bytes, bytes]:
        with self.lock, tempfile.TemporaryDirectory(prefix="titanctl-cli-") as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            out.touch()
            err.touch()
            request = {"args": args, "env": env, "cwd": cwd, "stdin": os.devnull, "stdout": str(out), "stderr": str(err)}
            self.sock.sendall(json.dumps(request).encode() + b"\n")
            pid = self._answer(timeout=60)["pid"]
            try:
                status = self._answer(timeout)["status"]
            except TimeoutError:
                try:
                    os.killpg(pid, signal.SIGKILL)  # the child and whatever it started
                except ProcessLookupError:
                    pass
                self._answer(timeout=60)  # reaped
                raise subprocess.TimeoutExpired(args, timeout, out.read_bytes(), err.read_bytes()) from None
            return status, out.read_bytes(), err.read_bytes()


def _text(data: bytes) -> str:
    """As subprocess's text mode reads a pipe: the locale's encoding, universal newlines."""
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


_SERVERS: dict[tuple, _Server] = {}  # by the variables read at start
_MAX_SERVERS = 4
_STARTING = threading.Lock()


def titanctl_run(args, *, env: dict | None = None, cwd=None, timeout: float | None = None, input=None,
                 text: bool = True) -> subprocess.CompletedProcess:
    """``subprocess.run([*TITANCTL, *args], capture_output=True, ...)``, answered the same, faster."""
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    at_start = tuple(sorted((k, v) for k, v in env.items() if READ_AT_START.match(k)))
    with _STARTING:
        if at_start not in _SERVERS and len(_SERVERS) < _MAX_SERVERS:
            _SERVERS[at_start] = _Server(env)
    server = _SERVERS.get(at_start)
    if input is not None or server is None or not server.serves():
        return subprocess.run([*TITANCTL, *args], capture_output=True, text=text, env=env, cwd=cwd, timeout=timeout,
                              input=input)
    code, out, err = server.run([os.fsdecode(a) for a in args], env, cwd, timeout)
    if text:
        return subprocess.CompletedProcess([*TITANCTL, *args], code, _text(out), _text(err))
    return subprocess.CompletedProcess([*TITANCTL, *args], code, out, err)


# ----------------------------------------------------------------------------- for shell scripts
# A shell script's `titanctl` (the docs' runnable blocks) reaches the same servers through a socket:
# tests/cli_client.py sends its arguments, environment and folder, and prints what the command printed.


@contextlib.contextmanager
def shell_endpoint(socket_path: Path):
    """Serve tests/cli_client.py's requests at ``socket_path`` while the block runs; yields the
    command line that stands for ``python -m titanctl``."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_path))
    listener.listen()
    listener.settimeout(0.1)  # to see ``done`` (closing a socket does not end an accept() under way)
    done = threading.Event()

    def answer(conn: socket.socket) -> None:
        with conn, conn.makefile("rwb") as stream:
            request = json.loads(stream.readline())
            proc = titanctl_run(request["args"], env=request["env"], cwd=request["cwd"], timeout=600, text=False)
            reply = {"code": proc.returncode, "stdout": base64.b64encode(proc.stdout).decode(),
                     "stderr": base64.b64encode(proc.stderr).decode()}
            stream.write(json.dumps(reply).encode() + b"\n")

    def accept() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            answer(conn)

    thread = threading.Thread(target=accept, name="titanctl shell endpoint", daemon=True)
    thread.start()
    try:
        yield [sys.executable, "-S", str(REPO / "tests" / "cli_client.py"), str(socket_path)]
    finally:
        done.set()
        thread.join(timeout=60)
        listener.close()

"""Start the suite's torchrun worker scripts as forks of a process that has torch imported.

Importing torch and its distributed packages costs each worker process about 1.2 CPU-s before it does
anything, and the suite starts over a hundred workers (workers/ckpt_worker.py, workers/world_worker.py).
Each pytest process starts one server (``start``): it imports what tests/cli_server.py's servers import
(torch and its DTensor and DCP, nothing of titanctl) and listens on a Unix socket named by
``TITANCTL_TEST_FORK_SERVER``, which every process the tests start inherits.

A worker script calls ``hand_over()`` first thing. When the variable names a server that was started with
the same variables read at start (OMP_NUM_THREADS, PYTHONPATH, ...), the script's process becomes a thin
client: it passes the server its arguments, environment, folder and standard streams, the server forks a
child that runs the script as ``__main__`` with them, and the client exits as the child did (the same exit
code, or the same signal). Signals sent to the client (torchrun's SIGTERM) go on to the child; when the
client dies (SIGKILL), the server kills the child, and a child dies with its server. Otherwise ``hand_over`` returns and the script runs
in its own process, as it always could.

What differs: SIGSTOP cannot be passed on; the child's /proc entry shows the server's command line and
environment; and a worker starts in a fraction of a second (a restarted torchft replica group rejoins before
its peers have trained a step without it). Tests that need the real thing launch with ``OWN_PROCESSES``.

Standard library only: a client must start in milliseconds.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

VARIABLE = "TITANCTL_TEST_FORK_SERVER"
# In a launch's environment: its worker scripts run in processes of their own. For tests that stop a worker
# with SIGSTOP, find it in /proc, or need a restarted one to take as long to start as a real process.
OWN_PROCESSES = {VARIABLE: ""}

# What Python, the C library, OpenMP, MKL, oneDNN or torch read when the interpreter or torch starts;
# and the tests' secret, which they look for in /proc/self/environ: a forked child's is its server's.
# Not what is read later: what torchrun sets for each worker (TORCHELASTIC_*, TORCH_NCCL_*) and its
# rendezvous reads (TORCH_DISABLE_SHARE_RDZV_TCP_STORE), the Flight Recorder's settings (TORCH_FR_*, read
# when the first process group is made), torchft's (TORCHFT_*), or inductor's and dynamo's
# (TORCHINDUCTOR_*, TORCHDYNAMO_*): the server imports neither, and inductor sets its cache folder's
# variable in the process that first compiles.
READ_AT_START = re.compile(r"^(PYTHON|LANG$|LC_|LANGUAGE$|OMP_|KMP_|GOMP_|MKL_|ONEDNN_|DNNL_|ATEN_|"
                           r"TORCH(?!ELASTIC_|_NCCL_|_DISABLE_SHARE_RDZV_TCP_STORE$|_FR_|FT_|INDUCTOR_|DYNAMO_)|"
                           r"PYTORCH|LD_|MALLOC|GLIBC|OPENBLAS|CUDA|NVIDIA|TMPDIR$|HOME$|TITANCTL_TEST_SECRET$)")
# torch's DTensor and DCP too: neither imports inductor or dynamo, whose configuration titanctl sets at
# its own import (titanctl/_inductor_cache.py).
PRELOADED = ("torch", "torch.distributed.tensor", "torch.distributed.checkpoint", "numpy", "safetensors", "rich",
             "typer")
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_IN_CHILD = [False]  # set in a forked child: its script's own hand_over() returns


def read_at_start(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if READ_AT_START.match(k)}


# ----------------------------------------------------------------------------- the client


def hand_over() -> None:
    """Run this script in a fork of the session's server and exit as it did; return if there is none."""
    path = os.environ.get(VARIABLE)
    if _IN_CHILD[0] or not path:
        return
    request = {"argv": [os.path.abspath(sys.argv[0]), *sys.argv[1:]], "env": dict(os.environ), "cwd": os.getcwd()}
    sys.stdout.flush()
    sys.stderr.flush()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    except OSError:  # not listening (yet, or any more)
        sock.close()
        return
    stream = sock.makefile("rb")
    try:
        reply = json.loads(stream.readline() or b'{"refused": "the server ended"}')
    except OSError:  # it ended (its children die with it)
        reply = {"refused": "the server ended"}
    if "refused" in reply:
        stream.close()
        sock.close()
        return
    child = reply["pid"]

    def forward(sig, _frame):
        try:
            os.killpg(child, sig)  # the child leads a session, as torchrun starts its workers
        except ProcessLookupError:
            pass

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    try:
        line = stream.readline()
    except OSError:
        line = b""
    code = json.loads(line)["status"] if line else 1  # no answer: the server, and so the child, ended
    if code < 0:  # killed by a signal: so is the client
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


# ----------------------------------------------------------------------------- the server


def start(env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """Start a server for clients whose variables read at start are ``env``'s; (it, its socket path). It
    ends when its standard input closes (the caller's end)."""
    folder = tempfile.mkdtemp(prefix="titanctl-fork-")
    path = os.path.join(folder, "server.sock")
    # torch imports numpy, whose OpenBLAS starts a thread pool unless told to stay single-threaded: the
    # server must have one thread to fork (titanctl's numpy does no BLAS work).
    proc = subprocess.Popen(
        [sys.executable, "-u", "-c", "import sys; from tests.fork_server import serve_and_become; "
         "serve_and_become(sys.argv[1], sys.argv[2])", path, json.dumps(read_at_start(env))],
        env={**env, "OPENBLAS_NUM_THREADS": "1"}, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, path


def serve_and_become(path: str, expected_json: str) -> None:
    """The server's main: serve until standard input closes; in a forked child, run its script."""
    request = _serve(path, json.loads(expected_json))
    if request is not None:
        _become(request)


def preload() -> bool:
    """Import :data:`PRELOADED` as titanctl.gc_pauses.heavy_imports would (titanctl stays unimported):
    a child's collections never walk it. Whether this process can still fork safely (one thread)."""
    import gc

    gc.disable()
    for name in PRELOADED:
        __import__(name)
    gc.freeze()
    gc.enable()
    return len(os.listdir("/proc/self/task")) == 1


def _serve(path: str, expected: dict[str, str]) -> dict | None:
    try:
        os.close(os.pidfd_open(os.getpid()))  # how it learns that a child ended (Linux 5.3 and later)
    except (AttributeError, OSError):
        return None
    if not preload():
        return None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, ("accept", None))
    selector.register(sys.stdin, selectors.EVENT_READ, ("stdin", None))
    children: dict[int, tuple[int, socket.socket]] = {}  # pid -> (its pidfd, its client's connection)
    while True:
        for key, _ in selector.select():
            what, pid = key.data
            if what == "stdin":
                for child in children:
                    _kill(child)
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
                return None
            if what == "accept":
                conn, _ = listener.accept()
                received = _receive(conn)
                if received is None:  # the client died before its request was whole
                    conn.close()
                    continue
                request, fds = received
                problem = _refusal(request, expected)
                if problem is not None:
                    for fd in fds:
                        os.close(fd)
                    _answer(conn, {"refused": problem})
                    conn.close()
                    continue
                server, pid = os.getpid(), os.fork()
                if pid == 0:
                    _leave_the_server(server, selector, listener, children, conn, fds)
                    return request
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                children[pid] = (pidfd, conn)
                selector.register(pidfd, selectors.EVENT_READ, ("child", pid))
                selector.register(conn, selectors.EVENT_READ, ("client", pid))  # readable: its client died
                _answer(conn, {"pid": pid})  # if the client died meanwhile, its connection says so next
                continue
            if pid not in children:  # its child ended and was answered earlier in this batch of events
                continue
            pidfd, conn = children[pid]
            if what == "client":  # the client sends nothing more: it closed, so it died
                selector.unregister(conn)
                _kill(pid)
                continue
            del children[pid]  # the child ended
            _, status = os.waitpid(pid, 0)
            selector.unregister(pidfd)
            os.close(pidfd)
            try:
                selector.unregister(conn)
            except KeyError:  # unregistered when its client died
                pass
            _answer(conn, {"status": os.waitstatus_to_exitcode(status)})
            conn.close()


def _answer(conn: socket.socket, reply: dict) -> None:
    try:
        conn.sendall(json.dumps(reply).encode() + b"\n")
    except OSError:  # the client died
        pass


def _leave_the_server(server: int, selector, listener, children, conn, fds: list[int]) -> None:
    """In a forked child: drop the server's sockets and pidfds, lead a session of its own, take the client's
    standard streams, and die with the server (a child whose server is gone has no one to report to)."""
    import ctypes

    selector.close()
    listener.close()
    for pidfd, other in children.values():
        os.close(pidfd)
        other.close()
    conn.close()
    os.setsid()
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != server:  # it died before that took hold
        os._exit(1)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)


def _receive(conn: socket.socket) -> tuple[dict, list[int]] | None:
    """The client's request and its standard streams; None if it closed first."""
    data, fds = b"", []
    conn.settimeout(30)
    try:
        while not data.endswith(b"\n"):
            chunk, more, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            fds += more
            if not chunk:
                break
            data += chunk
        request = json.loads(data) if data.endswith(b"\n") else None
    except (OSError, ValueError):
        request = None
    conn.settimeout(None)
    if request is None or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return None
    return request, fds


def _refusal(request: dict, expected: dict[str, str]) -> str | None:
    got = read_at_start(request["env"])
    if got != expected:
        differ = sorted(k for k in got.keys() | expected.keys() if got.get(k) != expected.get(k))
        return f"variables read at start differ: {', '.join(differ)}"
    return None


def _kill(pid: int) -> None:
    for send in (os.killpg, os.kill):  # before its setsid the child is in the server's group
        try:
            send(pid, signal.SIGKILL)
            return
        except (ProcessLookupError, PermissionError):
            continue


def _become(request: dict) -> None:
    """In the forked child: the client's environment, folder and arguments; run its script as
    ``__main__``. The interpreter then ends as the script's own would (exit code, atexit, tracebacks)."""
    import runpy

    _IN_CHILD[0] = True  # signal handlers: the server never changed an interpreter's own
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script, *args = request["argv"]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.realpath(script))  # as `python script.py` puts it first
    runpy.run_path(script, run_name="__main__")

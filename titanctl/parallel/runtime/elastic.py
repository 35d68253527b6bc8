"""Restarts under ``torchrun --max-restarts``: a clean process group for every attempt.

torchrun's agent keeps one TCPStore for the whole job and hands it to every attempt of the
workers (``TORCHELASTIC_USE_AGENT_STORE=True``). The keys a dead attempt wrote there (each rank's
gloo or NCCL address) stay behind, so a restarted rank can read a peer's address from the dead
attempt before the peer has written its new one and fail with "Gloo connectFullMesh failed ...
Connection refused" (torch 2.13, ``--standalone``: about one restart in three). Giving every attempt
its own key prefix, ``titanctl/attempt_{TORCHELASTIC_RESTART_COUNT}``, makes the old keys
invisible.

The restart count is kept per agent, i.e. per node, and torchrun does not synchronize it between
nodes: an agent that restarts its workers because another node rejoined does not count that as a
restart. On one node the count is therefore the same for every rank. Across nodes it matches when
every node's workers fail together (what happens when a rank dies: its peers' collectives fail),
but not always, so multi-node jobs should also set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: then
every rendezvous round gets a fresh store hosted by the new rank 0 and no prefix is needed
(``slurm/multinode_trainer.slurm`` sets it).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from titanctl.errors import TitanError
from titanctl.safe_io import open_no_follow

if TYPE_CHECKING:
    import torch.distributed as dist


@dataclass(frozen=True)
class Attempt:
    """Which attempt of a torchrun job this process belongs to."""

    restart: int  # 0 for the first attempt
    max_restarts: int
    nodes: int  # agents (nodes) in this rendezvous round

    @classmethod
    def from_env(cls) -> Attempt:
        return cls(
            restart=int_from_env("TORCHELASTIC_RESTART_COUNT", 0, minimum=0),
            max_restarts=int_from_env("TORCHELASTIC_MAX_RESTARTS", 0, minimum=0),
            nodes=int_from_env("GROUP_WORLD_SIZE", 1, minimum=1),
        )

    @property
    def is_restart(self) -> bool:
        return self.restart > 0

    @property
    def is_last(self) -> bool:
        """Restarts are exhausted: if this attempt fails, the job ends."""
        return self.restart >= self.max_restarts

    def after_failure(self) -> str:
        """What happens to the job when this attempt fails."""
        used = f"{self.restart} of {self.max_restarts}"
        if self.is_last:
            return f"restarts exhausted ({used} used): the same command resumes from it"
        return f"torchrun restarts the job ({used} restarts used so far), which resumes from it"


# An integer as torchrun writes one: ASCII digits, at most 18 of them (int() would also take
# "1_000", " 7 " and other scripts' digits).
_INTEGER = re.compile(r"[+-]?[0-9]{1,18}")


def int_from_env(name: str, default: int | None, *, minimum: int, maximum: int | None = None) -> int:
    """The integer in environment variable `name` (`default` when unset; None: it must be set), or a
    one-line TitanError naming the variable and what would be valid. A TitanError, not a
    ConfigError: every rank prints its own (its variables may be the wrong ones)."""
    raw = os.environ.get(name)
    if raw is None and default is not None:
        return default
    bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
    if raw is None:
        raise TitanError(f"environment variable {name} is not set: expected an integer {bounds} (torchrun sets it)")
    value = int(raw) if _INTEGER.fullmatch(raw) else None
    if value is None or value < minimum or (maximum is not None and value > maximum):
        raise TitanError(
            f"environment variable {name} is {raw!r}: expected an integer {bounds} (torchrun sets it; unset it "
            "to run a single process)"
        )
    return value


def uses_shared_agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def attempt_store(world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """The store this attempt's process group must rendezvous over, or None where torch's own
    ``env://`` store is already fresh (no torchrun, or a store per rendezvous round)."""
    if not uses_shared_agent_store():
        return None
    # torch is imported here, not at the top: the CLI reports errors through this module
    # (record_failure) without paying for importing torch.
    import torch.distributed as dist

    attempt = Attempt.from_env()
    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int_from_env("MASTER_PORT", None, minimum=1, maximum=65535),
        world_size=world_size,
        is_master=False,  # the agent hosts it
        timeout=timeout,
    )
    return dist.PrefixStore(f"titanctl/attempt_{attempt.restart}", store)


def multinode_restart_note(attempt: Attempt) -> str | None:
    """A warning for the case the attempt prefix cannot make safe (see the module doc)."""
    if attempt.nodes > 1 and attempt.max_restarts > 0 and uses_shared_agent_store():
        return (
            "restarts across nodes: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun (a fresh store per "
            "rendezvous round); torchrun counts restarts per node, so a restarted attempt may otherwise wait for "
            "peers that look for it under another restart count"
        )
    return None


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


class Terminated(BaseException):
    """torchrun stopped this worker with SIGTERM (another rank failed, or the job is being shut down).

    A BaseException, like KeyboardInterrupt, so that no ``except Exception`` on the way swallows it."""


@contextlib.contextmanager
def sigterm_raises(announce: Callable[[], None] | None = None) -> Iterator[None]:
    """Inside the block SIGTERM raises :class:`Terminated` in the main thread, so that the worker can
    say where the run stands before it goes (see :func:`die_of_sigterm`).

    Python runs a signal handler only once the main thread is back in the interpreter, and a main
    thread blocked in a collective whose peer died can stay in C++ until torchrun SIGKILLs it (30 s
    later). So ``announce``, if given, runs on a watcher thread as soon as the signal arrives (the
    interpreter's C-level handler writes it to a wakeup fd); wrap it in :func:`once` and call it
    again from the ``except Terminated`` path, whichever comes first."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    watcher = _SignalWatcher(signal.SIGTERM, announce) if announce is not None else None
    try:
        yield
    finally:
        if watcher is not None:
            watcher.stop()
        signal.signal(signal.SIGTERM, previous)


class _SignalWatcher:
    """Calls ``action`` on a daemon thread when ``signum`` reaches the process (main thread only)."""

    def __init__(self, signum: int, action: Callable[[], None]):
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # the C handler must never block on it
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, args=(signum, action), daemon=True)
        self._thread.start()

    def _watch(self, signum: int, action: Callable[[], None]) -> None:
        with os.fdopen(self._read, "rb", buffering=0) as pipe:
            while byte := pipe.read(1):  # b"" once stop() closed the write end
                if byte[0] == signum:
                    action()

    def stop(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._write)
        self._thread.join(timeout=5)


def once(action: Callable[[], None]) -> Callable[[], None]:
    """``action`` on the first call only, whichever thread makes it; later calls wait for it to end."""
    lock = threading.Lock()
    done = False

    def call() -> None:
        nonlocal done
        with lock:
            if not done:
                done = True
                action()

    return call


def die_of_sigterm() -> None:
    """End the process by SIGTERM itself, so that torchrun reports this rank as stopped by the signal
    (and keeps the rank that really failed as the root cause)."""
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    os._exit(128 + signal.SIGTERM)  # not reached


def record_failure(message: str, *, first_hand: bool = False) -> None:
    """Give torchrun this rank's reason for failing: its end-of-job summary ("Root Cause", "Failures")
    prints it instead of "To enable traceback see ...". torchrun names the file in
    TORCHELASTIC_ERROR_FILE; the plain form ``{"message": str, "timestamp": int}`` is one of the two it reads.

    torchrun calls the failure with the smallest timestamp the root cause, and stamps a rank that
    left no file (SIGKILL, the OOM killer) with the second it noticed. A rank that reports is often
    only a victim of that one (its collective failed when the peer vanished), so its report is
    stamped a second late: a silent death stays the root cause, and reports keep their order.
    ``first_hand``: an error that no peer caused (a config or layout refusal, which every rank meets before
    any collective) is stamped on time, so that a peer torchrun stopped meanwhile (SIGTERM, stamped the
    second torchrun noticed) never becomes the root cause in its place."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    report = json.dumps({"message": message, "timestamp": int(time.time()) + (0 if first_hand else 1)})
    # Written beside it and renamed into place: torchrun reads the file as soon as this rank is gone, and a
    # rank stopped between truncating and writing it left an empty file that crashed torchrun's agent
    # (JSONDecodeError) instead of restarting the job.
    target = Path(path)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        if target.is_symlink() or (target.exists() and not target.is_file()):
            return  # the report is a courtesy: never put in place of a link or a folder
        fd = open_no_follow(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, what="torchrun error file")
        with os.fdopen(fd, "w") as f:
            f.write(report)
        os.replace(partial, target)
    except (OSError, TitanError):
        with contextlib.suppress(OSError):
            partial.unlink()  # the exit code still tells torchrun

"""Flight Recorder, runtime side: switch it on, dump it, and dump when a step hangs.

PyTorch's Flight Recorder keeps a ring buffer of the last N collectives each process group
issued (op, sequence id, tensor sizes, Python stack). Measured on torch 2.13.0 (CPU, gloo):

- ``TORCH_FR_BUFFER_SIZE`` is read once, when the first process group is created: setting it
  later has no effect. Unset, the buffer holds 2000 entries; ``0`` turns recording off.
  ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is the deprecated spelling (it warns; the new one wins).
- ``torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=None, onlyActive=None)``
  returns the buffer as JSON bytes (``entries``, ``pg_config``, ``pg_status``, ``version``).
  Under gloo ``pg_config`` is a placeholder without ranks and entries never leave the
  ``scheduled`` state, so :func:`dump` adds the group layout itself.
- gloo never dumps on its own when a collective hangs: :class:`CollectiveWatchdog` does.
  NCCL jobs can also dump by themselves on a timeout; ``TORCH_FR_DUMP_TEMP_FILE`` is the file
  prefix torch uses then (those dumps are pickles; ``titanctl inspect-trace`` reads them safely).

torch is imported inside the functions, so importing this module is free.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from titanctl import _torch_compat
from titanctl.errors import TorchInternalsError
from titanctl.safe_io import create_new, visible

BUFFER_SIZE_ENV = "TORCH_FR_BUFFER_SIZE"
DUMP_FILE_ENV = "TORCH_FR_DUMP_TEMP_FILE"
NCCL_DUMP_ON_TIMEOUT_ENV = "TORCH_NCCL_DUMP_ON_TIMEOUT"

# torchft: the replica group this process belongs to, named in its dumps and messages (the ranks of
# every group are numbered from 0, so a rank alone does not say which group stalled).
_replica_group: list[int | None] = [None]


def set_replica_group(group: int | None) -> None:
    _replica_group[0] = group


def who(rank: int) -> str:
    """'rank 3', or under torchft 'replica group 1 rank 3'."""
    group = _replica_group[0]
    return f"rank {rank}" if group is None else f"replica group {group} rank {rank}"


def enable(buffer_size: int = 2000, dump_folder: Path | None = None) -> dict[str, str]:
    """Record the last ``buffer_size`` collectives of every process group created after this call.

    Call it before ``init_process_group``. With ``dump_folder``, NCCL's own dumps on a timeout
    land in ``{dump_folder}/nccl/rank{N}`` (pickles) once :func:`create_nccl_dump_folder` made that
    folder: nothing is written here, so a run refused later (a bad layout, a dump folder owned by
    another run) leaves no trace. Returns the environment variables that were set.
    """
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 0:
        raise ValueError(f"buffer_size must be an int >= 0, got {buffer_size!r}")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "hang_watchdog.enable() must run before the process group is created: "
            f"{BUFFER_SIZE_ENV} is read only then"
        )
    env = {BUFFER_SIZE_ENV: str(buffer_size)}
    if dump_folder is not None:
        # torch appends the rank to this prefix. A subfolder, so that these pickles and our own
        # rank{N}.json dumps are not read as two dumps of the same rank.
        env[DUMP_FILE_ENV] = str(Path(dump_folder) / "nccl" / "rank")
        # read by the CUDA build only (not present in the CPU build, so not verified here)
        env[NCCL_DUMP_ON_TIMEOUT_ENV] = os.environ.get(NCCL_DUMP_ON_TIMEOUT_ENV, "1")
    os.environ.update(env)
    return env


def create_nccl_dump_folder(dump_folder: Path) -> None:
    """The folder NCCL writes its own dumps into (it does not create it)."""
    (Path(dump_folder) / "nccl").mkdir(parents=True, exist_ok=True)


def _process_groups() -> dict[str, dict[str, Any]]:
    """``{group name: {name, desc, ranks}}`` of this process, in the shape of torch's ``pg_config``."""
    import torch.distributed as dist  # (see the module docstring: importing this module is free)

    if not (dist.is_available() and dist.is_initialized()):
        return {}
    try:
        names = _torch_compat.process_group_names()
    except TorchInternalsError:
        return {}  # the dump keeps torch's own (gloo: placeholder) pg_config
    groups: dict[str, dict[str, Any]] = {}
    for pg, name in names.items():
        try:
            ranks = dist.get_process_group_ranks(pg)
        except Exception:  # a group this rank is not part of
            continue
        groups[str(name)] = {
            "name": str(name),
            "desc": str(getattr(pg, "group_desc", "") or ""),
            "ranks": str(list(ranks)),
        }
    return groups


def snapshot(rank: int, reason: str = "") -> dict[str, Any]:
    """This process's Flight Recorder buffer as a dict, with the group layout filled in."""
    import torch.distributed as dist

    dump_fr_trace_json = _torch_compat.DUMP_FR_TRACE_JSON.get()
    data = json.loads(dump_fr_trace_json(includeCollectives=True, onlyActive=False))
    groups = _process_groups()
    if groups:
        # gloo leaves a placeholder ({"": {"ranks": "[]"}}); keep real entries torch did write.
        native = {
            k: v for k, v in (data.get("pg_config") or {}).items()
            if k and isinstance(v, dict) and v.get("ranks") not in (None, "", "[]")
        }
        data["pg_config"] = {**groups, **native}
    data["rank"] = rank
    data["titanctl"] = {
        "rank": rank,
        "world_size": dist.get_world_size() if dist.is_available() and dist.is_initialized() else None,
        "reason": reason,
        **({} if _replica_group[0] is None else {"replica_group": _replica_group[0]}),
        "time_unix": time.time(),
        "pid": os.getpid(),
    }
    return data


def dump(folder: Path, rank: int, reason: str = "") -> Path:
    """Write this rank's Flight Recorder buffer to ``{folder}/rank{rank}.json`` atomically.

    Safe to call from a watchdog thread while the main thread is blocked in a collective.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}.json"
    tmp = folder / f".rank{rank}.json.{os.getpid()}.{threading.get_ident()}.tmp"
    payload = json.dumps(snapshot(rank, reason), indent=1)
    try:
        with create_new(tmp, what="Flight Recorder dump") as f:
            f.write(payload.encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # readers see the old dump or the whole new one, never half of it
    finally:
        tmp.unlink(missing_ok=True)
    return path


class DumpOnce:
    """A callback that dumps this rank's buffer the first time it is called, then optionally exits.

    Use it as the watchdog's ``on_timeout`` and from your exception handler alike: whichever
    comes first dumps, the other waits for that dump and reuses it.
    """

    def __init__(
        self, folder: Path, rank: int, exit_code: int | None = None, before_exit: Callable[[str], Any] | None = None
    ) -> None:
        self.folder, self.rank, self.exit_code = Path(folder), rank, exit_code
        self.before_exit = before_exit  # told the reason and the dump before the process exits
        self.path: Path | None = None
        self._lock = threading.Lock()

    def __call__(self, label: str = "", elapsed_s: float = 0.0) -> Path:
        with self._lock:
            reason = f"{label} exceeded watchdog after {elapsed_s:.1f}s" if elapsed_s else label
            if self.path is None:
                self.path = dump(self.folder, self.rank, reason)
                shown_path = visible(str(self.path))  # the dump folder is input
                print(f"[{who(self.rank)}] flight recorder dump: {shown_path}", file=sys.stderr, flush=True)
            if self.exit_code is not None:
                if self.before_exit is not None:
                    self.before_exit(f"{reason}; flight recorder dump {self.path}")
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(self.exit_code)  # the main thread may be stuck in a collective forever
            return self.path


class CollectiveWatchdog:
    """Call ``on_timeout(label, elapsed_s)`` from a daemon thread when a watched block runs too long.

    >>> wd = CollectiveWatchdog(600, DumpOnce(dump_folder, rank))
    >>> with wd.watch(f"step {step}"):
    ...     train_step()

    ``on_timeout`` runs at most once per watched block, on the watchdog thread (the main thread
    is typically blocked inside a collective). ``fired`` is set once it has returned.
    """

    def __init__(self, timeout_s: float, on_timeout: Callable[[str, float], Any], poll_s: float = 0.5) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.on_timeout = on_timeout
        self.fired = threading.Event()
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._started_at = 0.0
        self._label = ""
        self._closed = False
        self._poll_s = poll_s
        self._thread = threading.Thread(target=self._run, name="titanctl-collective-watchdog", daemon=True)
        self._thread.start()

    def arm(self, label: str = "") -> None:
        with self._cond:
            self._label = label
            self._started_at = time.monotonic()
            self._deadline = self._started_at + self.timeout_s
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None
            self._cond.notify()

    @contextmanager
    def watch(self, label: str = "") -> Iterator[CollectiveWatchdog]:
        self.arm(label)
        try:
            yield self
        finally:
            self.disarm()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._deadline is None or time.monotonic() < self._deadline):
                    wait = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
                    self._cond.wait(timeout=wait if wait is None else min(wait, self._poll_s))
                if self._closed:
                    return
                label, elapsed = self._label, time.monotonic() - self._started_at
                self._deadline = None  # once per watched block
            self.on_timeout(label, elapsed)
            self.fired.set()

"""A run's dump folder: usable, owned by one run at a time, and one metrics row per step.

Two runs on one dump folder would interleave ``metrics.jsonl`` and delete each other's
checkpoints, so a run holds an exclusive lock on ``{dump_folder}/.titanctl.lock`` from start to
end (rank 0 for the whole job). The lock is ``flock``: the kernel drops it when its holder dies,
so a crashed run (or the dead attempt of a torchrun restart) never blocks the next one; the file
names the holder (host, PID, start time) so that a refusal can say who owns the folder. A holder
that ends cleanly removes the file (the folder is left as it found it); one that died leaves its
name, and its successor says that it took over. ``flock`` is as reliable as the file system's
locking (local file systems and Lustre with ``-o flock`` honour it across processes; some NFS setups
only within one host).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
from pathlib import Path

from titanctl.errors import ConfigError, TitanError
from titanctl.safe_io import (
    cannot_create_in,
    open_for_append,
    open_no_follow,
    parse_json,
    read_bytes,
    read_text,
    replace_atomically,
    visible,
)

LOCK_BYTES = 4096  # host, PID and start time: a few dozen bytes
METRICS_BYTES = 1 << 30  # ~3 M rows
LOCK_FILE = ".titanctl.lock"
METRICS_FILE = "metrics.jsonl"
FLIGHT_RECORDER_FOLDER = "flight_recorder"


def prepare(folder: Path, subfolders: list[str] = (), written: dict[str, str] | None = None) -> None:
    """Create the dump folder if needed, or say in one line why it cannot hold a run.

    ``subfolders`` (relative to it: checkpoints, TensorBoard, traces) must not lead through a
    symbolic link: a folder that ships ``checkpoint`` as a link to ``~`` would have titanctl write
    there and prune what it finds. Those that this run writes into (``written``: subfolder -> what
    it holds, see ``folders_written``) must be writable now: a read-only checkpoint folder
    otherwise failed at the first save, after the steps before it were trained for nothing."""
    key = f"job.dump_folder {str(folder)!r}"
    for parent in [folder, *folder.parents]:
        if parent.exists() and not parent.is_dir():
            what = "is a file" if parent == folder else f"is inside {parent}, which is a file"
            raise ConfigError(f"{key} {what}: choose a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{key} cannot be created: {e.strerror or e}; choose a writable folder") from None
    reason = cannot_create_in(folder)
    if reason:
        raise ConfigError(f"{key} cannot be written ({reason}); choose a writable folder")
    for sub in subfolders:
        path = folder
        for part in Path(sub).parts:
            path = path / part
            if path.is_symlink():
                raise ConfigError(f"{path} is a symbolic link; titanctl does not write through links: remove it")
    for sub, what in (written or {}).items():
        _check_writable(folder / sub, what)


def folders_written(cfg, distributed: bool) -> dict[str, str]:
    """The subfolders of the dump folder that a run of ``cfg`` (a JobConfig) writes into, and what they hold."""
    written = {}
    if cfg.checkpoint.enable_checkpoint or cfg.checkpoint.create_seed_checkpoint:
        written[cfg.checkpoint.folder] = "checkpoint folder"
    if cfg.metrics.enable_tensorboard:
        written[cfg.metrics.save_tb_folder] = "TensorBoard folder"
    if cfg.profiling.enable_profiling:
        written[cfg.profiling.save_traces_folder] = "profiler trace folder"
    if cfg.profiling.enable_memory_snapshot:
        written[cfg.profiling.save_memory_snapshot_folder] = "memory snapshot folder"
    if distributed and cfg.comm.trace_buf_size:
        written[FLIGHT_RECORDER_FOLDER] = "Flight Recorder folder"  # the hang watchdog's dumps
    return written


def _check_writable(path: Path, what: str) -> None:
    """``path`` is a folder this process can create files in, or one it can create: else one line."""
    existing = path
    while not os.path.lexists(existing):  # where the run's mkdir will create it
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{what} {visible(str(path))}: {visible(str(existing))} is a file; move it away")
    reason = cannot_create_in(existing)
    if reason:
        where = "" if existing == path else f" (in {visible(str(existing))})"
        raise ConfigError(
            f"{what} {visible(str(path))} cannot be written{where}: {reason}; make it writable or choose "
            "another job.dump_folder"
        )


class RunLock:
    """The exclusive lock of one run on its dump folder.

    Held per process: several ``Trainer`` objects of one process (a library user's, or tests') may
    share a folder one after the other; the lock goes when the last of them releases it.
    """

    _held: dict[Path, list] = {}  # lock file -> [fd, holders] of this process

    def __init__(self, folder: Path):
        self.path = folder / LOCK_FILE
        self._key: Path | None = None

    def acquire(self) -> str | None:
        """Take the lock, or raise naming its holder. Returns a note when a dead run's lock was taken over."""
        key = self.path.resolve()
        if key in RunLock._held:
            RunLock._held[key][1] += 1
            self._key = key
            return None
        fd = self._lock_file()
        previous = _read(self.path)
        mine = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(mine).encode(), 0)
        RunLock._held[key] = [fd, 1]
        self._key = key
        if previous:
            return f"took over the dump folder lock of {_describe(previous)}, which is no longer running"
        return None

    def _lock_file(self) -> int:
        """An open, flocked descriptor of the lock file that is still at ``self.path``."""
        while True:
            fd = open_no_follow(self.path, os.O_RDWR | os.O_CREAT, what="the dump folder lock", error=ConfigError)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise ConfigError(f"cannot lock {self.path}: {e.strerror or e}") from None
                raise ConfigError(
                    f"job.dump_folder {str(self.path.parent)!r} is in use by another run "
                    f"({_describe(_read(self.path))}); wait for it to end or choose another job.dump_folder"
                ) from None
            try:
                if os.fstat(fd).st_ino == os.lstat(self.path).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)  # the holder removed this file while we waited for it: lock the new one

    def release(self) -> None:
        key, self._key = self._key, None
        if key is None:
            return
        held = RunLock._held[key]
        held[1] -= 1
        if held[1]:
            return
        fd = RunLock._held.pop(key)[0]
        try:
            self.path.unlink(missing_ok=True)  # a clean end: nobody to take over from, nothing left behind
        finally:
            os.close(fd)  # closing drops the flock


def _read(path: Path) -> dict:
    """The holder a lock file names; {} for anything else (a link, a FIFO, garbage, deep nesting)."""
    if path.is_symlink():
        return {}
    try:
        holder = parse_json(read_text(path, what="the dump folder lock", max_bytes=LOCK_BYTES) or "{}", what="lock")
    except TitanError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict) -> str:
    if not holder:
        return "holder unknown"
    return f"host {holder.get('host', '?')}, PID {holder.get('pid', '?')}, started {holder.get('started', '?')}"


def supersede_metrics(folder: Path, start_step: int) -> str | None:
    """Make ``metrics.jsonl`` hold one row per step for a run that continues after ``start_step``.

    A resumed run re-trains the steps after its checkpoint: their earlier rows (from the attempt
    that died) move to ``metrics.superseded.jsonl``. A run that starts at step 0 in a folder with
    rows of an earlier run moves that file to ``metrics.<time>.jsonl`` and starts a new one.
    A line that is not a row of ours (not UTF-8, not JSON, no step that is an integer >= 0, such as
    ``"step": 1e999``) stays where it is, and the note says which. Nothing is deleted. Returns what
    was done, for the console.
    """
    path = folder / METRICS_FILE
    if not os.path.lexists(path):
        return None
    if path.is_symlink():
        raise ConfigError(f"{path} is a symbolic link; titanctl does not write through links: remove it")
    lines = read_bytes(path, what="metrics file", max_bytes=METRICS_BYTES, error=ConfigError).splitlines(keepends=True)
    if not lines:
        return None
    if start_step == 0:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
        kept = folder / f"metrics.{stamp}.jsonl"
        os.replace(path, kept)
        return f"{path} held an earlier run's rows: moved to {kept.name}; this run starts a new {METRICS_FILE}"
    keep, drop, unreadable = [], [], []
    for number, line in enumerate(lines, 1):
        step = _step(line)
        if step is None and line.strip():
            unreadable.append(number)
        (drop if step is not None and step > start_step else keep).append(line)
    notes = []
    if drop:
        with open_for_append(folder / "metrics.superseded.jsonl", what="metrics file", error=ConfigError) as f:
            f.write(b"".join(drop).decode("utf-8"))  # the rows moved are ours: UTF-8 by construction
        replace_atomically(path, b"".join(keep), what="metrics file", error=ConfigError)
        notes.append(f"{len(drop)} row(s) after step {start_step} of the interrupted attempt moved to "
                     "metrics.superseded.jsonl")
    if unreadable:
        shown_lines = ", ".join(map(str, unreadable[:5])) + (", ..." if len(unreadable) > 5 else "")
        notes.append(f"{len(unreadable)} line(s) of {visible(str(path))} hold no readable step (line "
                     f"{shown_lines}): kept where they are")
    return "; ".join(notes) or None


def _step(line: bytes) -> int | None:
    """The step of one of our rows; None for anything else."""
    try:
        row = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None

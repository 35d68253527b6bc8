"""Per-file checksums of a checkpoint: recorded at save, verified before a tensor is used.

A flipped bit inside a ``.distcp`` file loads without complaint and surfaces much later as a
NaN; a checksum names the damaged file at once. At save every rank hashes the files it wrote
(:class:`ChecksumWriter`), rank 0 gathers them (:func:`gather_checksums`) and records them, with
the hash of ``.metadata`` and ``config.toml``, in ``titanctl.json`` under ``checksums`` before
the rename that makes the step visible. On load :func:`verify` hashes the files again, split
over the ranks when a process group is given.

SHA-256, chosen by measuring ``hashlib`` on this project's 2-core CPU (SHA extensions), 512 MiB in
16 MiB updates: SHA-256 1.83 GiB/s, BLAKE2b 1.24, SHA-512 1.05, BLAKE2s 0.68 per core (SHA-1, 1.92,
is broken; CRC-32, 5.9, is no hash of a shared file). ``sha256sum FILE`` also checks a file by
hand. hashlib releases the GIL, so several files hash in parallel threads. Checkpoints without
``checksums`` (written before titanctl recorded them, or by plain DCP) are read unverified.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from titanctl.checkpoint.trust.paths import inside
from titanctl.errors import CheckpointCorrupt, CheckpointError
from titanctl.parallel.runtime import elastic

ALGORITHM = "sha256"
MANIFEST_SINCE = 2  # titanctl.json version from which a checkpoint must record its checksums
_CHUNK = 16 * 2**20


def file_digest(path: Path) -> str:
    digest = hashlib.new(ALGORITHM)
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _threads(count: int) -> int:
    per_host = elastic.int_from_env("LOCAL_WORLD_SIZE", 1, minimum=1)
    return max(1, min(count, 8, (os.cpu_count() or 1) // max(1, per_host)))


def digest_files(folder: Path, names: list[str]) -> dict[str, str]:
    """{name: hex digest} of files of `folder`, hashed in parallel threads."""
    if not names:
        return {}
    with ThreadPoolExecutor(_threads(len(names))) as pool:
        return dict(zip(names, pool.map(lambda name: file_digest(Path(folder) / name), names)))


def record(files: dict[str, str]) -> dict[str, Any]:
    """The ``checksums`` entry of titanctl.json."""
    return {"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}


class ChecksumWriter(FileSystemWriter):
    """DCP's file-system writer that hashes every file this rank wrote, once it is written
    (still in the page cache). The digests wait in ``checksums`` for :func:`gather_checksums`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checksums: dict[str, str] = {}

    def write_data(self, plan, planner):
        done = super().write_data(plan, planner)  # DCP's writer is synchronous: already complete
        written = sorted({result.storage_data.relative_path for result in done.wait()})
        self.checksums = digest_files(Path(self.path), written)
        return done


def gather_checksums(mine: dict[str, str], group) -> dict[str, str]:
    """Every rank's digests, on every rank of `group` (one process: its own). JSON in uint8
    tensors over the checkpoint's gloo group, so nothing is pickled."""
    if group is None:
        return dict(mine)

    data = torch.frombuffer(bytearray(json.dumps(mine).encode()), dtype=torch.uint8)
    world = dist.get_world_size(group)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    everyone = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(everyone, padded, group=group)
    merged: dict[str, str] = {}
    for blob, n in zip(everyone, sizes):
        merged.update(json.loads(blob[: int(n.item())].numpy().tobytes()))
    return merged


def recorded(meta: dict[str, Any] | None, where: Path) -> dict[str, str] | None:
    """{file name: digest} from a titanctl.json, None when it records none; checked for shape."""
    entry = (meta or {}).get("checksums")
    if entry is None:
        return None
    files = entry.get("files") if isinstance(entry, dict) else None
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise CheckpointError(f"{where}: 'checksums' is not {{'algorithm': ..., 'files': {{name: digest}}}}")
    if entry.get("algorithm") != ALGORITHM:
        raise CheckpointError(
            f"{where}: unknown checksum algorithm {entry.get('algorithm')!r} (titanctl uses {ALGORITHM!r})"
        )
    return files


def require_manifest(meta: dict[str, Any] | None, where: Path) -> None:
    """A titanctl.json of a version that always records checksums must still have them: deleting
    the whole entry must not turn a damaged checkpoint into an unverified one."""
    version = (meta or {}).get("version", 1)
    if meta is not None and "checksums" not in meta and isinstance(version, int) and version >= MANIFEST_SINCE:
        raise CheckpointCorrupt(
            f"{where} records no checksums, but titanctl writes them with every checkpoint of version "
            f"{version}: the manifest was removed or the file was altered"
        )


def require_listed(folder: Path, files: dict[str, str], needed: list[str]) -> None:
    """Every file the checkpoint needs must have a recorded checksum: a damaged shard whose record
    was deleted must not load unchecked."""
    for name in sorted(needed):
        if name not in files:
            raise CheckpointCorrupt(
                f"{Path(folder) / name} has no checksum in the checkpoint's titanctl.json, which records every "
                "file titanctl wrote: the manifest was altered"
            )


def verify(folder: Path, files: dict[str, str], names: list[str] | None = None, group=None) -> None:
    """Hash `names` (default: every recorded file) and compare; a one-line CheckpointCorrupt naming
    the first bad file otherwise. With `group`, each rank hashes a share and all agree on the verdict."""
    folder = Path(folder)
    names = sorted(files if names is None else names)
    for name in names:  # cheap, identical on every rank: a missing file is named as missing
        path = inside(folder, name, f"{folder}/titanctl.json")
        if not path.is_file():
            raise CheckpointCorrupt(f"{path} is missing (the checkpoint's titanctl.json records its checksum)")
    rank, world = 0, 1
    if group is not None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = names[rank::world]
    unreadable: OSError | None = None
    try:
        digests = digest_files(folder, mine)
        bad = min((names.index(n) for n in mine if digests[n] != files[n]), default=len(names))
    except OSError as e:  # every rank must still reach the collective below
        unreadable, bad = e, -1
    if group is not None:
        verdict = torch.tensor([bad], dtype=torch.int64)
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=group)
        bad = int(verdict.item())
    if bad < 0:
        where = unreadable.filename if unreadable is not None else f"a file of {folder}"
        reason = (unreadable.strerror or str(unreadable)) if unreadable is not None else "on another rank"
        raise CheckpointError(f"cannot read {where} ({reason}) to verify its checksum")
    if bad < len(names):
        raise CheckpointCorrupt(
            f"{folder / names[bad]} does not match the {ALGORITHM} checksum recorded when the checkpoint was "
            "saved: the file is damaged or was modified"
        )

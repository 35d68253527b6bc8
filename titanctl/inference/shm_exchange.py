"""All-gather among processes of one host through shared memory, for CPU tensor-parallel decoding.

A decoded token on a small model needs ``2 x n_layers + 1`` collectives of a few KiB each. Over gloo
each is a TCP round trip through the process group's worker threads, 0.2-1.6 ms on a virtual machine
(``docs/generation.md``), more than the token's arithmetic. Ranks on one host can instead meet in a
shared memory segment, as the CPU backends of vLLM and DeepSpeed inference do: each rank copies its
piece into its own slot, publishes a sequence number, and spins until every other rank has published
the same one, then reads all slots. No thread is woken and no system call is made.

Layout of the segment: one 64-byte line per rank for its published count, then two banks of
``tp`` slots. Collective number ``s`` uses bank ``s % 2``: a rank may overwrite its slot in that bank
(at ``s + 2``) only after every rank has published ``s + 1``, which each does after reading bank
``s % 2`` at ``s``, so no slot is rewritten while someone still reads it.

Ordering relies on x86-64's memory model (stores become visible in program order, loads are not
reordered with loads); on other CPUs :func:`create` returns ``None`` and gloo is used.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

SLOT_BYTES = 1 << 20  # larger tensors (long prompts' logits) go through the process group
_LINE = 64  # bytes per rank's counter: counters of different ranks never share a cache line
_NONCE = 16  # bytes after the counters: proof that every rank mapped the same segment
_SPINS_BEFORE_YIELD = 2000
TIMEOUT_SECONDS = 600.0

_EXCHANGES: dict[int, SharedMemoryExchange] = {}


class SharedMemoryExchange:
    """One rank's view of a segment shared by the ``tp`` ranks of a process group on one host."""

    def __init__(self, buffer: mmap.mmap, rank: int, tp: int, key: int):
        self.rank, self.tp, self.key = rank, tp, key
        self._buffer = buffer
        self._counters = np.frombuffer(buffer, dtype=np.int64, count=tp * _LINE // 8)[:: _LINE // 8]
        data = torch.frombuffer(buffer, dtype=torch.uint8, offset=_header_bytes(tp))
        self._banks = data.view(2, tp, SLOT_BYTES)
        self._count = 0

    def fits(self, nbytes: int) -> bool:
        return nbytes <= SLOT_BYTES

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(tp, *x.shape): every rank's ``x`` in rank order; every rank must call with the same shape."""
        self._count += 1
        count, nbytes = self._count, x.numel() * x.element_size()
        bank = self._banks[count % 2]
        bank[self.rank, :nbytes].copy_(x.contiguous().view(-1).view(torch.uint8))
        self._counters[self.rank] = count  # published after the data, which x86 keeps in order
        self._wait_for(count)
        return bank[:, :nbytes].clone().view(x.dtype).view(self.tp, *x.shape)

    def _wait_for(self, count: int) -> None:
        counters = self._counters
        deadline = None
        for peer in range(self.tp):
            spins = 0
            while counters[peer] < count:
                spins += 1
                if spins % _SPINS_BEFORE_YIELD == 0:
                    os.sched_yield()  # lets a descheduled peer run when cores are oversubscribed
                    now = time.monotonic()
                    deadline = deadline or now + TIMEOUT_SECONDS
                    if now > deadline:
                        raise RuntimeError(
                            f"tensor-parallel rank {peer} did not reach collective {count} within "
                            f"{TIMEOUT_SECONDS:.0f} s (rank {self.rank} waited in shared memory)"
                        )


def _header_bytes(tp: int) -> int:
    return -(-(tp * _LINE + _NONCE) // 4096) * 4096  # slots start page-aligned


def create(group: dist.ProcessGroup) -> SharedMemoryExchange | None:
    """A shared segment for ``group``'s ranks, or ``None`` where they cannot all map one.

    Collective over ``group``: its first rank makes the segment and broadcasts its path and a random
    nonce; the others map it and check the nonce (ranks on another host find no file, or another
    file), and all agree on the outcome. The file is removed once mapped, so it never outlives the job.
    """
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    size = _header_bytes(tp) + 2 * tp * SLOT_BYTES
    supported = platform.machine().lower() in ("x86_64", "amd64")
    path, buffer, nonce = None, None, None
    if rank == 0 and supported:
        nonce = secrets.token_bytes(_NONCE)
        path, buffer = _make_segment(size, tp, nonce)
    shared = [str(path) if path else None, nonce]
    dist.broadcast_object_list(shared, group_src=0, group=group)
    path_text, nonce = shared
    if rank != 0 and path_text is not None:
        buffer = _map_segment(Path(path_text), size, tp, nonce)
    mapped = [None] * tp
    dist.all_gather_object(mapped, supported and buffer is not None, group=group)
    if rank == 0 and path is not None:
        path.unlink(missing_ok=True)
    if not all(mapped):
        if buffer is not None:
            buffer.close()
        return None
    key = len(_EXCHANGES)
    _EXCHANGES[key] = SharedMemoryExchange(buffer, rank, tp, key)
    return _EXCHANGES[key]


def _segment_folder() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _make_segment(size: int, tp: int, nonce: bytes) -> tuple[Path, mmap.mmap] | tuple[None, None]:
    path = _segment_folder() / f"titanctl-tp-{os.getpid()}-{secrets.token_hex(8)}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # a full tmpfs fails here, not with SIGBUS on first write
            buffer = mmap.mmap(fd, size)
        finally:
            os.close(fd)
    except OSError:
        path.unlink(missing_ok=True)
        return None, None
    buffer[tp * _LINE : tp * _LINE + _NONCE] = nonce
    return path, buffer


def _map_segment(path: Path, size: int, tp: int, nonce: bytes) -> mmap.mmap | None:
    try:
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                return None
            buffer = mmap.mmap(fd, size)
        finally:
            os.close(fd)
    except OSError:
        return None
    if buffer[tp * _LINE : tp * _LINE + _NONCE] != nonce:
        buffer.close()
        return None
    return buffer


@torch.library.custom_op("titanctl::shm_all_gather", mutates_args=())
def shm_all_gather(x: torch.Tensor, key: int) -> torch.Tensor:
    """:meth:`SharedMemoryExchange.all_gather` as an op ``torch.compile`` calls without tracing it."""
    return _EXCHANGES[key].all_gather(x)


@shm_all_gather.register_fake
def _(x: torch.Tensor, key: int) -> torch.Tensor:
    return x.new_empty(_EXCHANGES[key].tp, *x.shape)

"""Simulated ranks for in-process tests of collective algorithms: one thread per rank."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


def run_ranks(cp: int, rank: Callable[[int], None], barrier: threading.Barrier) -> None:
    """``rank(r)`` for every r in a thread of its own; the first rank's failure is raised here, after
    ``barrier`` is aborted so that no peer waits for it forever."""
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            rank(r)
        except BaseException as e:  # surface a rank's failure in the test
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class FakeMesh:
    """A device mesh of one dimension as a thread rank sees it: its size and this rank."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


class ThreadGather:
    """The all-gather of cp threads: each hands its (2, ...) pieces, all get the (2cp, ...) cat in rank order."""

    def __init__(self, cp: int):
        self.barrier = threading.Barrier(cp, timeout=60)
        self.slots: list = [None] * cp

    def __call__(self, rank: int, pieces: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = pieces
        self.barrier.wait()
        every = torch.cat(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank read it
        return every


class ThreadAllToAll:
    """cp threads' all-to-all: rank r gets chunk r of every rank's (cp, ...) chunks, in rank order."""

    def __init__(self, cp: int):
        self.barrier = threading.Barrier(cp, timeout=30)
        self.slots: list = [None] * cp

    def __call__(self, rank: int, chunks: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = chunks
        self.barrier.wait()
        got = torch.stack([slot[rank] for slot in self.slots])
        self.barrier.wait()  # nobody overwrites a slot before every rank read it
        return got

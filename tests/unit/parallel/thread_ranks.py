"""Simulated ranks for in-process tests of collective algorithms: one thread per rank."""

from __future__ import annotations

import threading
from collections.abc import Callable


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

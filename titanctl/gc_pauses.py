"""Where titanctl pauses Python's cyclic garbage collector, and why.

- ``automatic_gc_paused``: no automatic collection inside a training step (the Trainer collects every
  ``training.gc_freq`` steps instead, never mid-step: a collection pause on one rank stalls every rank at
  the next collective), nor inside estimate-memory's step (whether a collection ran mid-step decided which
  tensors held by reference cycles counted at the peak).
- ``heavy_imports``: importing titanctl's training stack (torch, its distributed packages, dynamo, sympy)
  creates objects that live as long as the process. With the collector running, each automatic collection
  during the import walks again every object imported so far: about a fifth of a training process's start,
  which every ``titanctl`` command and every torchrun worker pays (``benchmarks/startup.py`` prints it).
  Paused during the import and frozen afterwards (``gc.freeze``), they are never walked, then or later.

Nothing here imports torch: the CLI imports this module before it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def automatic_gc_paused() -> Iterator[None]:
    """No automatic collection inside the block; the collector as it was after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def heavy_imports() -> Iterator[None]:
    """The imports inside run without automatic collections; every object alive at the end is frozen."""
    with automatic_gc_paused():
        try:
            yield
        finally:
            gc.freeze()

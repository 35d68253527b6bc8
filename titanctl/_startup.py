"""Import torch's stacks with Python's cyclic garbage collector paused, then freeze what they made.

Importing titanctl's training stack (torch, its distributed packages, dynamo, sympy) creates objects
that live as long as the process. With the collector running, each automatic collection during the
import walks again every object imported so far: about a fifth of a training process's start, which
every ``titanctl`` command and every torchrun worker pays (``benchmarks/startup.py`` prints it).
Paused during the import and frozen afterwards (``gc.freeze``), they are never walked, then or later.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def heavy_imports() -> Iterator[None]:
    """The imports inside run without automatic collections; every object alive at the end is frozen."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()

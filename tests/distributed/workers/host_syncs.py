"""Record every tensor-to-host read made while the Trainer's loop runs.

``record_host_syncs()`` patches the Tensor methods that read a value on the host (``item``,
``tolist``, ``cpu``, ``numpy``, truth value, ``float()``/``int()``, indexing with a tensor,
printing) and notes each call made under ``Trainer._train`` (the loop), with its call site. A call counts as
*allowed* when ``Trainer.read_losses`` or ``Trainer._log`` (which run on log steps only) is on
the stack. The first step of a process may read the host once to set itself up (a pipeline
schedule sends its stages' shapes as Python objects then): those calls are kept apart. Any other
call is a host sync in the step: a violation.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

import torch

SYNC_METHODS = (
    "item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__repr__", "__format__",
)
LOG_STEP_FUNCTIONS = {"read_losses", "_log"}


@dataclass
class HostSyncs:
    allowed: int = 0  # calls made by the log-step functions
    first_step: list[str] = field(default_factory=list)  # calls during the first step of the process
    violations: list[str] = field(default_factory=list)  # "method in function (file:line) <- ..." of any other


def _stack() -> list:
    frames, frame = [], sys._getframe(2)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def _in_trainer(frame, name: str) -> bool:
    return frame.f_code.co_name == name and frame.f_code.co_filename.endswith("titanctl/train/trainer.py")


@contextlib.contextmanager
def record_host_syncs():
    seen = HostSyncs()
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def patched(name):
        original = originals[name]

        def method(self, *args, **kwargs):
            frames = _stack()
            loop = next((f for f in frames if _in_trainer(f, "_train")), None)
            if loop is not None:
                if any(_in_trainer(f, fn) for f in frames for fn in LOG_STEP_FUNCTIONS):
                    seen.allowed += 1
                else:
                    where = " <- ".join(
                        f"{f.f_code.co_name} ({f.f_code.co_filename.rsplit('/', 2)[-1]}:{f.f_lineno})"
                        for f in frames[:6]
                    )
                    first = loop.f_locals["self"].step == loop.f_locals.get("start_step")
                    (seen.first_step if first else seen.violations).append(f"Tensor.{name} in {where}")
            return original(self, *args, **kwargs)

        return method

    for name in SYNC_METHODS:
        setattr(torch.Tensor, name, patched(name))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)

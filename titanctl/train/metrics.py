"""Where a logged step goes: metrics.jsonl always, TensorBoard and W&B when enabled.

Only ranks that log (rank 0 by default) create sinks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: the CUDA caching allocator's, or the CPU peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB -> GiB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricSinks:
    def __init__(self, dump_folder: Path, *, tensorboard_folder: Path | None, wandb_config: dict | None):
        dump_folder.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(dump_folder / "metrics.jsonl", "a", buffering=1)
        self._tb = None
        if tensorboard_folder is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(tensorboard_folder))
        self._wandb = None
        if wandb_config is not None:
            self._wandb = _start_wandb(dump_folder, wandb_config)

    def log(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self._jsonl.write(json.dumps(clean) + "\n")
        step = row["step"]
        numbers = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(f"train/{key}", value, step)
        if self._wandb is not None:
            self._wandb.log({f"train/{k}": v for k, v in numbers.items()}, step=step)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _start_wandb(dump_folder: Path, config: dict):
    from titanctl.errors import ConfigError

    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "metrics.enable_wandb = true but wandb is not installed: pip install 'titanctl[wandb]'"
        ) from None
    return wandb.init(dir=str(dump_folder), config=config, project="titanctl")

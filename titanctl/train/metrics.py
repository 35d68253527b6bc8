"""Where a logged step goes: metrics.jsonl always, TensorBoard and W&B when enabled.

Only ranks that log (rank 0 by default) create sinks.
"""

from __future__ import annotations

import json
import math
import resource
from pathlib import Path
from typing import Any

import torch

from titanctl.errors import ConfigError
from titanctl.safe_io import open_for_append


def cpu_peak_rss_gib() -> float:
    """Peak resident memory of this process (the whole run so far), in GiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB -> GiB
    except OSError:
        pass

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MemoryMonitor:
    """Memory columns of a log row, each about the log window since the previous row.

    CUDA: ``memory_gib`` is the caching allocator's peak reserved memory (what the GPU really had
    to give), ``memory_active_gib`` the peak of live tensors, ``memory_reserved_pct`` that peak
    reserved as a share of the device's memory, and ``num_alloc_retries`` / ``num_ooms`` how often
    the allocator had to free its cache and retry, or failed (retries mean fragmentation or a
    near-full device: they cost time). Peaks and counts restart each window.
    CPU: ``memory_gib`` is the process's peak resident memory (peak of the whole run).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.capacity = torch.cuda.get_device_properties(device).total_memory
            stats = torch.cuda.memory_stats(device)
            self._retries, self._ooms = stats.get("num_alloc_retries", 0), stats.get("num_ooms", 0)
            torch.cuda.reset_peak_memory_stats(device)

    def read(self) -> dict[str, float | int]:
        """This window's columns; starts the next window."""
        if not self.is_cuda:
            return {"memory_gib": round(cpu_peak_rss_gib(), 3)}
        stats = torch.cuda.memory_stats(self.device)
        reserved, active = stats.get("reserved_bytes.all.peak", 0), stats.get("active_bytes.all.peak", 0)
        retries, ooms = stats.get("num_alloc_retries", 0), stats.get("num_ooms", 0)
        row = {
            "memory_gib": round(reserved / 2**30, 3),
            "memory_active_gib": round(active / 2**30, 3),
            "memory_reserved_pct": round(100 * reserved / self.capacity, 2),
            "num_alloc_retries": retries - self._retries,
            "num_ooms": ooms - self._ooms,
        }
        self._retries, self._ooms = retries, ooms
        torch.cuda.reset_peak_memory_stats(self.device)
        return row


class MetricSinks:
    def __init__(self, dump_folder: Path, *, tensorboard_folder: Path | None, wandb_config: dict | None):
        dump_folder.mkdir(parents=True, exist_ok=True)
        self._jsonl = open_for_append(dump_folder / "metrics.jsonl", what="metrics file", error=ConfigError)
        self._tb = None
        if tensorboard_folder is not None:
            from torch.utils.tensorboard import SummaryWriter  # tensorboard + protobuf: only runs that log there

            self._tb = SummaryWriter(log_dir=str(tensorboard_folder))
        self._wandb = None
        if wandb_config is not None:
            self._wandb = _start_wandb(dump_folder, wandb_config)

    def log(self, row: dict[str, Any], histograms: dict[str, Any] | None = None) -> None:
        """One metrics.jsonl row; its numbers as TensorBoard/W&B scalars, and ``histograms``
        ({tag: values}) as TensorBoard histograms."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self._jsonl.write(json.dumps(clean) + "\n")
        step = row["step"]
        numbers = {_tag(k): v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        if self._tb is not None:
            for tag, value in numbers.items():
                self._tb.add_scalar(tag, value, step)
            for tag, values in (histograms or {}).items():
                self._tb.add_histogram(tag, values, step)
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _tag(key: str) -> str:
    """TensorBoard / W&B name of a row's key: val_loss -> validation/loss, loss -> train/loss."""
    return f"validation/{key[len('val_'):]}" if key.startswith("val_") else f"train/{key}"


def _start_wandb(dump_folder: Path, config: dict):
    try:
        import wandb  # optional dependency (pip install titanctl[wandb])
    except ImportError:
        raise ConfigError(
            "metrics.enable_wandb = true but wandb is not installed: pip install 'titanctl[wandb]'"
        ) from None
    return wandb.init(dir=str(dump_folder), config=config, project="titanctl")

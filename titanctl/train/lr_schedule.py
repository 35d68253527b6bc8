"""Warmup, then stable, then decay (linear, sqrt or cosine) to lr_min: WSD when decay_ratio is set."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from titanctl.config.job_config import LRScheduler


def lr_factor(step: int, *, total_steps: int, cfg: LRScheduler) -> float:
    """Multiplier of the peak lr for the optimizer step with 0-based index ``step``."""
    warmup = min(cfg.warmup_steps, total_steps)
    if step < warmup:
        # Never exactly zero: the first step already moves the weights a little.
        return (step + 1) / (warmup + 1)
    after_warmup = total_steps - warmup
    decay_steps = after_warmup if cfg.decay_ratio is None else round(total_steps * cfg.decay_ratio)
    decay_steps = min(decay_steps, after_warmup)
    decay_start = total_steps - decay_steps
    if step < decay_start or decay_steps == 0:
        return 1.0
    # Reaches 1 at the last step; the scheduler's final step() (after training) stays there.
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    if cfg.decay_type == "linear":
        curve = 1.0 - progress
    elif cfg.decay_type == "sqrt":
        curve = 1.0 - math.sqrt(progress)
    else:
        curve = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr_min + (1.0 - cfg.lr_min) * curve


def build_lr_scheduler(optimizer: Optimizer, cfg: LRScheduler, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, total_steps=total_steps, cfg=cfg))

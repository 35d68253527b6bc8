"""How a recipe becomes (sharded) model parts: the one place `train` and `estimate-memory` share."""

from __future__ import annotations

import torch
from torch import nn

from titanctl.config.job_config import JobConfig
from titanctl.models.llama import ModelArgs, Transformer
from titanctl.parallel.dims import ParallelDims
from titanctl.parallel.init import initialize_weights


def build_model_parts(
    cfg: JobConfig, dims: ParallelDims, args: ModelArgs, device: torch.device, *, init: bool = True
) -> list[nn.Module]:
    """Build on the meta device, parallelize, then materialize on ``device`` and initialize."""
    with torch.device("meta"):
        model = Transformer(args)
    parts = [model]
    for part in parts:
        part.to_empty(device=device)
        if init:
            initialize_weights(part, cfg.training.seed, buffer_device=device)
        part.train()
    return parts

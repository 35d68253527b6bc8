"""The optimizer: AdamW/Adam with the fastest kernel the parameters allow."""

from __future__ import annotations

import torch
from torch import nn

from titanctl.config.job_config import Optimizer as OptimizerConfig


def build_optimizer(model_parts: list[nn.Module], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.implementation == "fused":
        kwargs["fused"] = True
    elif cfg.implementation == "foreach":
        kwargs["foreach"] = True
    else:
        kwargs["foreach"] = False
    cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    try:
        return cls(params, **kwargs)
    except RuntimeError:
        if not kwargs.pop("fused", False):
            raise
        # The fused kernel does not cover every device/dtype (e.g. some DTensor layouts).
        return cls(params, foreach=True, **kwargs)

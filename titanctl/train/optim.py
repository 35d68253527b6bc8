"""The optimizer: AdamW/Adam with the fastest kernel the parameters allow, or Muon (with AdamW for the
parameters Muon does not suit), per parameter group."""

from __future__ import annotations

import torch
from torch import nn

from titanctl.config.job_config import Optimizer as OptimizerConfig
from titanctl.train.muon import Muon
from titanctl.train.param_groups import build_param_groups


def build_optimizer(model_parts: list[nn.Module], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    groups = build_param_groups(model_parts, cfg)
    if any(group["kind"] == "muon" for group in groups):
        return Muon(
            groups, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum, ns_steps=cfg.muon_ns_steps,
            ns_dtype=getattr(torch, cfg.muon_ns_dtype), betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
        )
    for group in groups:
        del group["kind"]
        group.pop("momentum", None)
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.implementation == "fused":
        kwargs["fused"] = True
    elif cfg.implementation == "foreach":
        kwargs["foreach"] = True
    else:
        kwargs["foreach"] = False
    cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    try:
        return cls(groups, **kwargs)
    except RuntimeError:
        if not kwargs.pop("fused", False):
            raise
        # The fused kernel does not cover every device/dtype (e.g. some DTensor layouts).
        return cls(groups, foreach=True, **kwargs)

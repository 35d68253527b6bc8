"""RMSNorm, written out or through ``F.rms_norm``: the same weights and the same math."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanctl.models.common.args import ModelArgs
from titanctl.models.common.init import ONES, ParamInit


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, normalized in fp32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def param_inits(self, depth: int | None) -> dict[str, ParamInit]:
        return {"weight": ONES}


class FusedRMSNorm(RMSNorm):
    """The same norm through ``F.rms_norm``. On CUDA that is one kernel forward and one backward
    instead of ~6 elementwise ops, each reading and writing the whole activation; elsewhere torch
    (2.13) has no such kernel and runs those same ops. It accumulates in fp32 too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # The fused kernel needs one dtype (autocast keeps fp32 weights beside bf16 activations).
        return F.rms_norm(x, self.weight.shape, None, self.eps) * self.weight


NORMS = {"rmsnorm": RMSNorm, "fused_rmsnorm": FusedRMSNorm}


def build_norm(args: ModelArgs, dim: int | None = None) -> RMSNorm:
    """The norm ``args`` asks for, over ``dim`` channels (default: the model width)."""
    if args.norm_type not in NORMS:
        raise ValueError(f"ModelArgs.norm_type {args.norm_type!r} is not one of {', '.join(NORMS)}")
    return NORMS[args.norm_type](dim or args.dim, args.norm_eps)

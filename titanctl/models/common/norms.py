"""RMSNorm, written out or through ``F.rms_norm``: the same weights and the same math.

A zero-centred norm (``ModelArgs.norm_offset``) scales by ``1 + weight``, its
weight starting at zero, so weight decay pulls it towards the identity scale rather than towards 0."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanctl.models.common.args import ModelArgs
from titanctl.models.common.init import ONES, ParamInit


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, normalized in fp32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32, or fp64 for fp64 input
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # scaled in fp32 before the cast back, as the zero-centred references do
            return (normed * (1.0 + self.weight.to(normed.dtype))).type_as(x)
        return normed.type_as(x) * self.weight

    def param_inits(self, depth: int | None) -> dict[str, ParamInit]:
        return {"weight": ParamInit("zeros") if self.offset else ONES}


class FusedRMSNorm(RMSNorm):
    """The same norm through ``F.rms_norm``. On CUDA that is one kernel forward and one backward
    instead of ~6 elementwise ops, each reading and writing the whole activation; elsewhere torch
    (2.13) has no such kernel and runs those same ops. It accumulates in fp32 too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:  # F.rms_norm has no (1 + weight) form
            return super().forward(x)
        if x.dtype == self.weight.dtype:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # The fused kernel needs one dtype (autocast keeps fp32 weights beside bf16 activations).
        return F.rms_norm(x, self.weight.shape, None, self.eps) * self.weight


NORMS = {"rmsnorm": RMSNorm, "fused_rmsnorm": FusedRMSNorm}


def build_norm(args: ModelArgs, dim: int | None = None) -> RMSNorm:
    """The norm ``args`` asks for, over ``dim`` channels (default: the model width)."""
    if args.norm_type not in NORMS:
        raise ValueError(f"ModelArgs.norm_type {args.norm_type!r} is not one of {', '.join(NORMS)}")
    return NORMS[args.norm_type](dim or args.dim, args.norm_eps, offset=args.norm_offset)

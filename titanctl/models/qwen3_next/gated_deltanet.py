"""Qwen3-Next's Gated DeltaNet: the shared layer with its input projections fused as the published
weights hold them, per key head h: ``wqkvz`` rows [q_h (dk) | k_h (dk) | v of h (g x dv) | z of h (g x dv)]
and ``wba`` rows [b of h (g) | a of h (g)], g = num_value_heads // num_key_heads.

The first three parts of a ``wqkvz`` group are exactly the shared layer's per-group ``wqkv`` rows, so the
conv, the rule and the norm run unchanged; and a contiguous split of either matrix's rows (tensor
parallelism) gives each rank whole key-head groups with their value heads' z, b and a.
"""

from __future__ import annotations

import torch
from torch import nn

from titanctl.models.common.args import LinearAttentionArgs
from titanctl.models.common.gated_deltanet import GatedDeltaNet


class FusedGatedDeltaNet(GatedDeltaNet):
    projections = ("wqkvz", "wba")

    def init_projections(self, dim: int, la: LinearAttentionArgs) -> None:
        self.wqkvz = nn.Linear(dim, la.conv_dim + la.value_dim, bias=False)
        self.wba = nn.Linear(dim, 2 * la.num_value_heads, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        la = self.la
        bsz, seqlen, _ = x.shape
        values = la.num_value_heads // la.num_key_heads * la.value_head_dim  # of one key head
        group = self.wqkvz(x).view(bsz, seqlen, -1, 2 * la.key_head_dim + 2 * values)  # (B, T, H_k, ...)
        qkv, z = group.split([2 * la.key_head_dim + values, values], dim=-1)
        b, a = self.wba(x).view(bsz, seqlen, group.shape[2], -1).chunk(2, dim=-1)  # (B, T, H_k, g) each
        return (qkv.reshape(bsz, seqlen, -1), z.reshape(bsz, seqlen, -1), b.reshape(bsz, seqlen, -1),
                a.reshape(bsz, seqlen, -1))

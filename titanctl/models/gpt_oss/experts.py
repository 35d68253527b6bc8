"""gpt-oss's routed experts: a clamped SwiGLU with biases, as stacked weights behind the shared seam."""

from __future__ import annotations

import torch
from torch import nn

from titanctl.models.common.args import MoEArgs
from titanctl.models.common.init import INPUT, ParamInit, output_projection
from titanctl.models.common.moe import RoutedExperts, autocast_operands, grouped_experts


class ClampedSwiGLUExperts(RoutedExperts):
    """E experts as stacked weights: w13 (E, 2 x hidden, dim), the gate's and the up projection's rows
    interleaved (gate j at row 2j, up j at 2j + 1), as openai's checkpoints and torchtitan hold them,
    with its bias b13 (E, 2 x hidden); w2 (E, dim, hidden) with b2 (E, dim). Each token's hidden units
    are gate * sigmoid(alpha * gate) * (up + 1), the gate clamped above and up on both sides at ``limit``."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, limit: float, alpha: float):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.b13 = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.b2 = nn.Parameter(torch.empty(num_experts, dim))
        self.limit, self.alpha = limit, alpha

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, dim): tokens sorted by expert, counts[e] of them for (local) expert e. Returns (M, dim)."""
        params = (self.w13, self.b13, self.w2, self.b2)
        w13, b13, w2, b2 = (w.to_local() if hasattr(w, "to_local") else w for w in params)
        x, w13, b13, w2, b2 = autocast_operands(x, w13, b13, w2, b2)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        # Each row's expert, for its biases: (M,), a static size (fake tensors allow it).
        expert_of_row = torch.repeat_interleave(torch.arange(counts.shape[0], device=x.device), counts,
                                                output_size=x.shape[0])
        h = self.grouped_mm(x, w13.transpose(-2, -1), offs=offsets) + b13[expert_of_row]  # (M, 2 x hidden)
        gate, up = h[..., 0::2].clamp(max=self.limit), h[..., 1::2].clamp(-self.limit, self.limit)
        h = gate * torch.sigmoid(gate * self.alpha) * (up + 1)  # (M, hidden)
        return self.grouped_mm(h, w2.transpose(-2, -1), offs=offsets) + b2[expert_of_row]

    def param_inits(self, depth: int) -> dict[str, ParamInit]:
        # The biases small but not zero, so that every layout's handling of them shows in the losses.
        return {"w13": INPUT, "b13": INPUT, "w2": output_projection(depth), "b2": INPUT}


def experts(dim: int, moe: MoEArgs) -> RoutedExperts:
    """``MoEArgs.expert_kind`` "clamped_swiglu" (gpt-oss's), else the shared experts."""
    if moe.expert_kind != "clamped_swiglu":
        return grouped_experts(dim, moe)
    return ClampedSwiGLUExperts(dim, moe.hidden_dim, moe.num_experts, moe.swiglu_limit, moe.swiglu_alpha)

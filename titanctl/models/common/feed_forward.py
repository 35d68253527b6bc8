"""SwiGLU feed-forward: w2(silu(w1 x) * w3 x)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanctl.models.common.init import INPUT, ParamInit, output_projection


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def param_inits(self, depth: int) -> dict[str, ParamInit]:
        return {"w1.weight": INPUT, "w2.weight": output_projection(depth), "w3.weight": output_projection(depth)}

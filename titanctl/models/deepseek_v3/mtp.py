"""DeepSeek-V3's multi-token prediction: one depth's norms and projection around its block (the
shared decoder runs the depths: ``titanctl.models.common.decoder``)."""

from __future__ import annotations

import torch
from torch import nn

from titanctl.models.common.args import ModelArgs
from titanctl.models.common.init import INPUT, ParamInit
from titanctl.models.common.norms import build_norm


class MultiTokenPrediction(nn.Module):
    """One depth around its block: the embedding of the token ``depth`` places ahead and position i's
    hidden state from the depth before (at depth 1 the main model's, after its final norm), each
    normalized, are concatenated in that order and projected back to dim (``eh_proj``) for the block;
    the block's output, through ``norm``, is this depth's hidden state, which the shared output layer
    reads and the next depth takes (as transformers' MtpLayer and the inference engines that run
    DeepSeek-V3's published MTP weights do)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.enorm = build_norm(args)
        self.hnorm = build_norm(args)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.norm = build_norm(args)

    def forward(self, h: torch.Tensor, ahead: torch.Tensor) -> torch.Tensor:
        """h, ahead (B, T, dim): hidden states and the embeddings of the tokens ahead -> the block's input."""
        return self.eh_proj(torch.cat([self.enorm(ahead), self.hnorm(h)], dim=-1))

    def param_inits(self, depth: int | None) -> dict[str, ParamInit]:
        return {"eh_proj.weight": INPUT}  # an input projection, as wq's

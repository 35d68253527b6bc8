"""DeepSeek-V4's multi-token prediction: one depth's norms and projections around its block, and the
streams' own collapse before the shared output layer (as DeepSeek's V4 inference code's MTPBlock).

Depth k's block is ``layers.{n_layers + k}``: a V4 block (hyper-connections, attention, MoE) with sliding
window attention and score-routed experts, as the published checkpoints' MTP layer (its compress ratio
0, past the main layers' in DeepSeek's config.json; no hash table). Its input is the embedding of the
token k + 1 places ahead, normalized and projected (``e_proj``), added to every stream of the depth
before (the main model's streams before their collapse at depth 1), each normalized and projected
(``h_proj``). Its output streams go to the next depth; this depth's logits read them through its own
``hc_head``, ``norm`` and the main model's output layer."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from titanctl.models.deepseek_v4.args import SLIDING, DeepseekV4Args
from titanctl.models.deepseek_v4.attention import RMSNorm
from titanctl.models.deepseek_v4.hyper_connections import HyperHead


def with_prediction_layers(args: DeepseekV4Args) -> DeepseekV4Args:
    """``args`` counting the depths' blocks as layers, its layer schedules going on past the main layers."""
    m = args.mtp_layers
    return dataclasses.replace(args, n_layers=args.n_layers + m, layer_types=args.attention_types + (SLIDING,) * m,
                               mlp_layer_types=args.mlp_types + ("moe",) * m)


class PredictionDepth(nn.Module):
    def __init__(self, args: DeepseekV4Args):
        super().__init__()
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.e_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.h_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.hc_head = HyperHead(args)
        self.norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, streams: torch.Tensor, ahead: torch.Tensor) -> torch.Tensor:
        """streams (B, S, n, D) of the depth before, ahead (B, S, D) embeddings -> the block's input streams."""
        return self.e_proj(self.enorm(ahead)).unsqueeze(2) + self.h_proj(self.hnorm(streams))

    def hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """The block's output streams -> the output layer's input (B, S, D)."""
        return self.norm(self.hc_head(streams))

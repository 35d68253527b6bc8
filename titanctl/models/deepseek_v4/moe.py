"""DeepSeek-V4's MoE: sqrt(softplus) scores, experts chosen by top-k of the biased scores or, in the
first layers, by a fixed token-id -> experts table (hash routing); clamped SwiGLU experts and one shared
expert (clamped too)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanctl.models.deepseek_v4.args import DeepseekV4Args


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    def __init__(self, args: DeepseekV4Args):
        super().__init__()
        self.limit = args.swiglu_limit
        self.gate_proj = nn.Linear(args.dim, args.moe_hidden_dim, bias=False)
        self.up_proj = nn.Linear(args.dim, args.moe_hidden_dim, bias=False)
        self.down_proj = nn.Linear(args.moe_hidden_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Experts(nn.Module):
    """Routed experts packed as transformers holds them: gate_up_proj (E, 2F, D) gate rows then up rows,
    down_proj (E, D, F)."""

    def __init__(self, args: DeepseekV4Args):
        super().__init__()
        self.limit = args.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(args.num_experts, 2 * args.moe_hidden_dim, args.dim))
        self.down_proj = nn.Parameter(torch.empty(args.num_experts, args.dim, args.moe_hidden_dim))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            token, slot = torch.where(experts == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(clamped_swiglu(gate, up, self.limit), self.down_proj[e])
            out = out.index_add(0, token, y * weights[token, slot, None])
        return out


def hash_table(vocab_size: int, num_experts: int, top_k: int, layer_id: int, device=None) -> torch.Tensor:
    """(vocab, top_k) distinct experts per token id, the same on every run and rank (seeded by the layer)."""
    gen = torch.Generator().manual_seed(1_000_003 + layer_id)
    table = torch.rand(vocab_size, num_experts, generator=gen).argsort(dim=-1)[:, :top_k]
    return table.to(device)


class MoE(nn.Module):
    def __init__(self, args: DeepseekV4Args, layer_id: int):
        super().__init__()
        self.hashed = args.mlp_types[layer_id] == "hash_moe"
        self.top_k, self.route_scale = args.top_k, args.route_scale
        self.router = nn.Linear(args.dim, args.num_experts, bias=False)
        self.num_experts = args.num_experts
        # Both saved state: a checkpoint's table and bias (the Hub's, trained) replace the fresh model's.
        if self.hashed:  # token id -> its top_k distinct experts, fixed: drawn by hash_table (seeded), not learned
            self.register_buffer("tid2eid", hash_table(args.vocab_size, args.num_experts, args.top_k, layer_id))
        else:  # load-balancing bias: moves the choice, not the weights (zero: titanctl does not move it yet)
            self.register_buffer("expert_bias", torch.zeros(args.num_experts))
        self.experts = Experts(args)
        self.shared_experts = SharedExpert(args)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        scores = F.softplus(self.router(flat)).sqrt()
        if self.hashed:
            chosen = self.tid2eid[tokens.reshape(-1)]
        else:
            chosen = torch.topk(scores + self.expert_bias.to(scores.dtype), self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.route_scale
        routed = self.experts(flat, chosen, weights).view(b, s, d)
        return routed + self.shared_experts(x)

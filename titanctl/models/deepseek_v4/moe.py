"""DeepSeek-V4's MoE: sqrt(softplus) scores, experts chosen by top-k of the biased scores or, in the
first layers, by a fixed token-id -> experts table (hash routing); clamped SwiGLU experts and one shared
expert (clamped too).

The routed experts sit behind the shared seam (``RoutedExperts.forward(tokens sorted by expert, counts)``,
titanctl.models.common.moe), where expert parallelism exchanges tokens: hash-routed layers and learned ones
alike, since both only choose which experts a token goes to. A token's k outputs are summed in routing
order (no ``index_add``), so a layout that moves tokens gives the same sums."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanctl.models.common.moe import RoutedExperts, _recomputing, autocast_operands
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


class Experts(RoutedExperts):
    """Routed experts packed as transformers holds them: gate_up_proj (E, 2F, D) gate rows then up rows,
    down_proj (E, D, F)."""

    def __init__(self, args: DeepseekV4Args):
        super().__init__()
        self.limit = args.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(args.num_experts, 2 * args.moe_hidden_dim, args.dim))
        self.down_proj = nn.Parameter(torch.empty(args.num_experts, args.dim, args.moe_hidden_dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, dim): tokens sorted by expert, counts[e] of them for (local) expert e. Returns (M, dim)."""
        # Under expert parallelism the stacks are DTensors split over experts: the local part is this rank's.
        gate_up, down = (w.to_local() if hasattr(w, "to_local") else w for w in (self.gate_up_proj, self.down_proj))
        x, gate_up, down = autocast_operands(x, gate_up, down)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate, up = self._per_expert(x, gate_up, counts, offsets).chunk(2, dim=-1)  # (M, F) each
        return self._per_expert(clamped_swiglu(gate, up, self.limit), down, counts, offsets)

    def _per_expert(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
                    offsets: torch.Tensor) -> torch.Tensor:
        """Rows of expert e through w[e] (out, in): one grouped GEMM, or in fp64 (the parity tests'
        precision, which torch._grouped_mm has no kernel for) one matmul per expert."""
        if x.dtype == torch.float64:
            return torch.cat([F.linear(rows, w_e) for rows, w_e in zip(x.split(counts.tolist()), w)])
        return self.grouped_mm(x, w.transpose(-2, -1), offs=offsets)


def hash_table(vocab_size: int, num_experts: int, top_k: int, layer_id: int, device=None) -> torch.Tensor:
    """(vocab, top_k) distinct experts per token id, the same on every run and rank (seeded by the layer)."""
    gen = torch.Generator().manual_seed(1_000_003 + layer_id)
    table = torch.rand(vocab_size, num_experts, generator=gen).argsort(dim=-1)[:, :top_k]
    return table.to(device)


class MoE(nn.Module):
    # What the inference decoder reads (generate.eager_part): the forward below is compiler-disabled.
    eager_in_compiled_graphs = "its MoE routing runs eagerly: its sizes depend on the data"

    def __init__(self, args: DeepseekV4Args, layer_id: int):
        super().__init__()
        self.hashed = args.mlp_types[layer_id] == "hash_moe"
        self.top_k, self.route_scale = args.top_k, args.route_scale
        self.router = nn.Linear(args.dim, args.num_experts, bias=False)
        self.num_experts = args.num_experts
        # Both saved state: a checkpoint's table and bias (the Hub's, trained) replace the fresh model's.
        if self.hashed:  # token id -> its top_k distinct experts, fixed: drawn by hash_table (seeded), not learned
            self.register_buffer("tid2eid", hash_table(args.vocab_size, args.num_experts, args.top_k, layer_id))
        else:  # load-balancing bias: moves the choice, not the weights; moe.load_balance_coeff trains it
            self.register_buffer("expert_bias", torch.zeros(args.num_experts))
        # Tokens routed to each expert since the trainer last read them (titanctl.train.moe_balance: the bias
        # update's input, and the expert-load metrics of both kinds of layer); not saved.
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.experts = Experts(args)
        self.shared_experts = SharedExpert(args)

    # Runs eagerly inside a compiled block, as the shared MoE does: the routing's sizes depend on the data.
    @torch.compiler.disable
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
        experts = chosen.reshape(-1)  # (N * k,) token n's j-th choice at n * k + j
        order = torch.argsort(experts, stable=True)  # by expert, then by token: a fixed order
        counts = experts.new_zeros(self.num_experts).scatter_add_(0, experts, torch.ones_like(experts))
        if torch.is_grad_enabled() and not _recomputing():  # training forwards, once under activation checkpointing
            self.tokens_per_expert.add_(counts)
        routed = self.experts(flat[order // self.top_k], counts)  # (N * k, dim)
        unsorted = torch.empty_like(routed).index_copy_(0, order, routed)  # a permutation: no accumulation
        out = (unsorted.view(-1, self.top_k, d) * weights.unsqueeze(-1).to(routed.dtype)).sum(dim=1)
        return out.view(b, s, d) + self.shared_experts(x)

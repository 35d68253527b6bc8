"""Mixture-of-Experts feed-forward shared by the MoE families: a top-k router, routed experts as
stacked weights run with grouped GEMMs, optional shared experts.

Dropless and deterministic: every token reaches its k experts (no capacity factor), and the tokens
an expert sees come in a fixed order (stable sort by expert, then by token position), so a layout
that moves tokens around (expert parallelism) can put them back in exactly that order. The
weighted combination of a token's k expert outputs is a sum in routing order, not an
``index_add`` (whose accumulation order is not fixed on every device).

Nothing here knows about parallelism: ``GroupedExperts.forward(tokens, counts)`` takes tokens
already sorted by expert and the count per expert, which is the seam where expert parallelism
(titanctl.parallel) exchanges tokens between ranks.

Load balancing is set from outside (titanctl.train.moe_balance): each MoE counts the tokens its
experts received (``tokens_per_expert``, the input of the auxiliary-loss-free bias update and of the
expert-load metrics), and with ``aux_loss_coef`` > 0 adds the gradient of a sequence-wise
auxiliary loss to its router.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanctl import _torch_compat
from titanctl.models.common.args import MoEArgs
from titanctl.models.common.feed_forward import FeedForward
from titanctl.models.common.init import INPUT, ParamInit, output_projection

_GRAPH_TASK_ID = _torch_compat.GRAPH_TASK_ID.get()


def _recomputing() -> bool:
    """Inside backward: activation checkpointing is running a forward again (whose tokens were
    already counted)."""
    return _GRAPH_TASK_ID() != -1


class _AddAuxLossGradient(torch.autograd.Function):
    """Returns ``out`` unchanged; in backward, also hands ``aux_loss`` the gradient 1, so the
    auxiliary loss joins the objective without passing through the training loss (under pipeline
    parallelism it lives on another stage)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux_loss.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return grad_out, grad_out.new_ones(ctx.aux_shape, dtype=torch.float32)


def sequence_aux_loss(
    scores: torch.Tensor, experts: torch.Tensor, batch: int, num_experts: int, reduce_sums=None
) -> torch.Tensor:
    """Switch-style balance loss per sequence, averaged over the batch: E x sum_e f_e P_e, with f_e
    the fraction of the sequence's tokens routed to expert e (over the k slots, as transformers'
    load_balancing_loss_func counts) and P_e the sequence's mean router probability of e.

    ``scores`` (N, E) probabilities, ``experts`` (N, k), N = batch x T local tokens. Where a
    sequence is split over ranks (context parallel), ``reduce_sums`` sums (batch, E) tensors over
    them; the returned value is then this rank's share, and the shares add up to the loss.
    """
    tokens = scores.shape[0] // batch
    routed = scores.new_zeros(batch, num_experts).scatter_add_(
        1, experts.reshape(batch, -1), scores.new_ones(batch, experts.numel() // batch)
    )  # (B, E) routing slots per expert
    sequence_len = torch.full((batch, 1), float(tokens), device=scores.device)
    if reduce_sums is not None:
        routed, sequence_len = reduce_sums(torch.cat([routed, sequence_len], dim=1)).split([num_experts, 1], 1)
    probability_sum = scores.reshape(batch, tokens, num_experts).sum(dim=1)  # (B, E), this rank's tokens
    per_sequence = num_experts * (routed / sequence_len * probability_sum / sequence_len).sum(dim=-1)
    return per_sequence.mean()


class Router(nn.Module):
    def __init__(self, dim: int, moe: MoEArgs):
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(dim, moe.num_experts, bias=moe.router_bias)
        # Set from outside to replace the chosen expert ids (N, k) by others (routing replay in RL: the
        # sampler's choices); the weights still come from this forward's scores at those experts.
        self.route_override = None
        if moe.n_group > 1 and (moe.num_experts % moe.n_group or not 1 <= moe.topk_group <= moe.n_group
                                or moe.top_k > moe.topk_group * (moe.num_experts // moe.n_group)):
            raise ValueError(f"MoEArgs: {moe.num_experts} experts in n_group {moe.n_group} groups, top_k "
                             f"{moe.top_k} of the topk_group {moe.topk_group} best: no such routing")

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, dim) -> (logits (N, E), expert ids (N, k), weights (N, k) in x's dtype).

        ``expert_bias`` (E,) shifts which experts are chosen but not their weights (auxiliary-loss-free
        balancing; zeros without it).
        """
        logits = self.gate(x)
        if self.moe.score_func == "softmax_topk":  # choose on the logits, weigh by a softmax over the chosen
            experts = torch.topk(logits.float() + expert_bias, self.moe.top_k, dim=-1, sorted=True).indices
            if self.route_override is not None:
                experts = self.route_override(experts)
            weights = F.softmax(logits.float().gather(-1, experts), dim=-1)
            return logits, experts, (weights * self.moe.route_scale).to(x.dtype)
        scores = self.scores(logits)
        choice = scores + expert_bias
        if self.moe.n_group > 1:
            choice = self.limit_to_groups(choice)
        # Sorted so that ties between equal scores resolve the same way in every layout.
        experts = torch.topk(choice, self.moe.top_k, dim=-1, sorted=True).indices
        if self.route_override is not None:
            experts = self.route_override(experts)
        weights = scores.gather(-1, experts)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, experts, (weights * self.moe.route_scale).to(x.dtype)

    def limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """(N, E) biased scores with every expert outside a token's topk_group best groups at -inf; a
        group's score is the sum of its two best experts'."""
        groups = choice.unflatten(-1, (self.moe.n_group, -1))  # (N, G, E / G)
        best = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(dim=-1)  # (N, G)
        kept = torch.topk(best, self.moe.topk_group, dim=-1, sorted=True).indices  # (N, topk_group)
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(-1, kept, True)  # (N, G)
        return groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)  # (N, E)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """(N, E) fp32 affinities that choose and weigh the experts (softmax_topk: over all of them, as
        the auxiliary loss reads them)."""
        if self.moe.score_func in ("softmax", "softmax_topk"):
            return F.softmax(logits, dim=-1, dtype=torch.float32)
        return torch.sigmoid(logits.float())

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """(N, E) the scores normalized to sum to 1 per token (sigmoid scores do not by themselves)."""
        scores = self.scores(logits)
        return scores if self.moe.score_func != "sigmoid" else scores / scores.sum(dim=-1, keepdim=True)

    def param_inits(self, depth: int) -> dict[str, ParamInit]:
        return {"gate.weight": INPUT, "gate.bias": INPUT}


def autocast_operands(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` in the autocast dtype when autocast is on, as it casts a linear's input and weights.

    Autocast leaves ``torch._grouped_mm`` alone (it is on none of its cast lists): under bf16 autocast
    (one process, DDP or TP without FSDP) the experts multiplied in fp32 beside a bf16 model, which on
    CUDA is not the grouped kernel but its fallback, one matmul per expert after copying the offsets to
    the host. FSDP's bf16 parameters need no cast (autocast is off there)."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) for t in tensors)


class RoutedExperts(nn.Module):
    """E experts as stacked weights [E, ...] behind one seam: ``forward(x, counts)`` takes tokens sorted
    by expert, ``counts[e]`` of them for (local) expert e, and returns their outputs in that order. That
    seam is where expert parallelism exchanges tokens between ranks; ``grouped_mm`` is looked up here,
    as compiled code cannot import it, and is what shape-only runs (memory estimates) replace."""

    def __init__(self):
        super().__init__()
        self.grouped_mm = _torch_compat.GROUPED_MM.get()


class GroupedExperts(RoutedExperts):
    """E SwiGLU experts as stacked weights: w1, w3 (E, hidden, dim) and w2 (E, dim, hidden)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, dim): tokens sorted by expert, counts[e] of them for expert e (of this module's
        experts, which under expert parallelism are this rank's). Returns (M, dim)."""
        # Under expert parallelism the weights are split over experts (DTensors): the local part
        # holds exactly this rank's experts.
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3))
        x, w1, w2, w3 = autocast_operands(x, w1, w2, w3)
        grouped_mm = self.grouped_mm
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = F.silu(grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
        h = h * grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
        return grouped_mm(h, w2.transpose(-2, -1), offs=offsets)

    def param_inits(self, depth: int) -> dict[str, ParamInit]:
        return {"w1": INPUT, "w2": output_projection(depth), "w3": output_projection(depth)}


def grouped_experts(dim: int, moe: MoEArgs) -> GroupedExperts:
    """The shared routed experts (``MoEArgs.expert_kind`` "swiglu"); a family with another kind builds its own
    (``Blocks.experts``)."""
    if moe.expert_kind != "swiglu":
        raise ValueError(f"MoEArgs.expert_kind {moe.expert_kind!r}: the shared experts are swiglu, and this "
                         "family's blocks build no other kind")
    return GroupedExperts(dim, moe.hidden_dim, moe.num_experts)


class MoE(nn.Module):
    # What the inference decoder reads (generate.eager_part): the forward below is compiler-disabled.
    eager_in_compiled_graphs = "its MoE routing runs eagerly: its sizes depend on the data"

    def __init__(self, dim: int, moe: MoEArgs, experts: RoutedExperts | None = None):
        """``experts``: the routed experts (a family's own kind); None: the shared ones."""
        super().__init__()
        self.moe = moe
        self.router = Router(dim, moe)
        self.experts = experts if experts is not None else grouped_experts(dim, moe)
        self.shared_experts = (
            FeedForward(dim, moe.hidden_dim * moe.num_shared_experts) if moe.num_shared_experts else None
        )
        # One logit per token whose sigmoid scales the shared experts' output (MoEArgs.shared_expert_gate).
        gated = moe.shared_expert_gate and moe.num_shared_experts
        self.shared_gate = nn.Linear(dim, 1, bias=False) if gated else None
        # Added to the routing scores to choose experts (auxiliary-loss-free balancing); updated
        # between steps by the trainer, never by a gradient. Saved with the weights.
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts), persistent=True)
        # Tokens routed to each expert since the trainer last read them (counted once per forward,
        # not again when activation checkpointing recomputes it).
        self.register_buffer("tokens_per_expert", torch.zeros(moe.num_experts), persistent=False)
        # The auxiliary loss's weight in the objective (0: off), and how to sum per-sequence
        # statistics over the ranks that share a sequence: both set by titanctl.train.moe_balance.
        self.aux_loss_coef = 0.0
        self.reduce_sequence_sums = None

    def param_inits(self, depth: int) -> dict[str, ParamInit]:
        return {"shared_gate.weight": INPUT} if self.shared_gate is not None else {}

    # Runs eagerly inside a compiled block: torch 2.13's fake (compile-time) kernel of _grouped_mm
    # accepts only bf16, and the routing's sizes depend on the data.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # (B, T, dim)
        x = x.reshape(-1, shape[-1])  # (N, dim)
        logits, experts, weights = self.router(x, self.expert_bias)
        flat = experts.reshape(-1)  # (N * k,) token n's j-th choice at n * k + j
        order = torch.argsort(flat, stable=True)  # by expert, then by token: a fixed order
        # A scatter rather than bincount: the same counts with a static shape (fake tensors allow it).
        counts = flat.new_zeros(self.moe.num_experts).scatter_add_(0, flat, torch.ones_like(flat))
        if torch.is_grad_enabled() and not _recomputing():  # training forwards only
            self.tokens_per_expert.add_(counts)
        routed = self.experts(x[order // self.moe.top_k], counts)  # (N * k, dim)
        unsorted = torch.empty_like(routed).index_copy_(0, order, routed)  # a permutation: no accumulation
        out = (unsorted.view(-1, self.moe.top_k, shape[-1]) * weights.unsqueeze(-1)).sum(dim=1)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        if self.aux_loss_coef and torch.is_grad_enabled():
            aux = sequence_aux_loss(
                self.router.probabilities(logits), experts, shape[0], self.moe.num_experts, self.reduce_sequence_sums
            )
            out = _AddAuxLossGradient.apply(out, aux * self.aux_loss_coef)
        return out.reshape(shape)

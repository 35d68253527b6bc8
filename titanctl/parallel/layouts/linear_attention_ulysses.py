"""Ulysses context parallel for Gated DeltaNet layers: an all-to-all gives each CP rank every position of the
sequence for 1/cp of the layer's heads, so the causal conv and the chunked delta rule run on them unchanged.

Under ``parallelism.context_parallel_method = "ulysses"`` each rank holds a contiguous 1/cp of the sequence
(ulysses.py). A Gated DeltaNet layer's heads are independent of one another from its input projections to its
gated norm: the conv is depthwise, and each value head's rule reads only its own key head's q and k. Its conv
channels are stored per key-head group ([q_h | k_h | the value heads of h], gated_deltanet.py), and b and a
per value head in the same group order, so a contiguous 1/cp of the channels, and of b and a, is the same
whole key-head groups (their value heads with them). So, in each layer:

1. after the input projections, one all-to-all of the conv's inputs and b and a (side by side, one message per
   peer) from (this rank's positions, every head) to (every position, this rank's H_k / cp key-head groups);
   the conv weight, ``a_log`` and ``dt_bias`` are cut to the same heads;
2. the conv and the rule run over the whole sequence in order, with the one-process document mask (Ulysses
   hands the kernels masks over all positions), so no state or halo crosses a rank;
3. one all-to-all of the rule's outputs back to (this rank's positions, every value head): the gate z, the
   norm and ``out_proj`` stay per token.

The all-to-alls' backward is the reverse all-to-all; a cut parameter's gradient is its heads' on this rank and
zero elsewhere, so the usual sum over the CP ranks completes it. No load balancing is needed: every rank runs
the whole sequence for the same number of heads. The key heads (after tensor parallelism: each rank's) must
divide by cp; ``check_gated_deltanet_ulysses`` refuses other layouts before any rank connects.

Under ``ulysses_ring`` this exchange runs over the rank's u Ulysses peers only (``cp_mesh`` is that mesh): the
layer then holds the ring group's positions, and linear_attention_cp.py's scan carries the state and the conv's
halo across the groups before ``to_sequence``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from titanctl.errors import ParallelError
from titanctl.models.common.gated_deltanet import GatedDeltaNet
from titanctl.parallel.layouts.ulysses import _AllToAll


class GatedDeltaNetHeads:
    """A Gated DeltaNet layer's exchange between sequence and head sharding over the CP group (module
    docstring): ``to_heads`` before the conv, ``share`` of its per-head parameters, ``to_sequence`` after the
    rule."""

    def __init__(self, cp_mesh):
        self.cp, self.rank = cp_mesh.size(), cp_mesh.get_local_rank()
        self.group = cp_mesh.get_group()

    def _all_to_all(self, chunks: Tensor) -> Tensor:
        """(cp, ...) chunk j to rank j; returns (cp, ...), chunk j from rank j (autograd: the reverse)."""
        return _AllToAll.apply(chunks, self.group)

    def to_heads(self, *per_head: Tensor) -> list[Tensor]:
        """Tensors (B, T / cp, W_i) whose last dim is split by heads -> (B, T, W_i / cp): every position, this
        rank's share of the heads, in one all-to-all."""
        batch, length = per_head[0].shape[:2]
        widths = [t.shape[-1] // self.cp for t in per_head]
        side_by_side = torch.cat([t.reshape(batch, length, self.cp, w) for t, w in zip(per_head, widths)], dim=-1)
        got = self._all_to_all(side_by_side.permute(2, 0, 1, 3))  # (cp: the positions' rank, B, T / cp, sum W)
        whole = got.permute(1, 0, 2, 3).reshape(batch, self.cp * length, -1)  # (B, T, sum W / cp)
        return list(whole.split(widths, dim=-1))

    def share(self, param: Tensor) -> Tensor:
        """This rank's 1/cp of a per-head parameter (its dim 0: conv channels or value heads)."""
        return param.view(self.cp, -1, *param.shape[1:])[self.rank]

    def to_sequence(self, out: Tensor) -> Tensor:
        """(B, T, H / cp, d) -> (B, T / cp, H, d): this rank's positions, every head."""
        batch, total, heads, dim = out.shape
        chunks = out.reshape(batch, self.cp, total // self.cp, heads, dim).transpose(0, 1)  # (cp: positions' rank)
        got = self._all_to_all(chunks)  # (cp: the heads' rank, B, T / cp, H / cp, d)
        return got.permute(1, 2, 0, 3, 4).reshape(batch, total // self.cp, self.cp * heads, dim)


def check_gated_deltanet_ulysses(args, tp: int, cp: int, degree: str = "context_parallel_degree") -> None:
    """Refuse, before any rank connects, key heads that do not split over tensor x context parallel (``cp``: the
    Ulysses ranks, ``degree`` the key that sets them: ulysses_ring's context_parallel_ulysses_degree)."""
    la = args.linear_attention
    if la is None or "linear_attention" not in args.layer_types:
        return
    if la.num_key_heads % (tp * cp):
        raise ParallelError(
            f"ulysses context parallel splits the Gated DeltaNet layers by key heads: linear_attention.num_key_heads = "
            f"{la.num_key_heads} is not divisible by tensor_parallel_degree x {degree} = {tp} x {cp}; "
            "use context_parallel_method = ring"
        )


def enable_gated_deltanet_ulysses(model: torch.nn.Module, cp_mesh) -> None:
    """Give every Gated DeltaNet layer of ``model`` the head exchange over ``cp_mesh`` (idempotent)."""
    for module in model.modules():
        if isinstance(module, GatedDeltaNet) and module.head_exchange is None:
            module.head_exchange = GatedDeltaNetHeads(cp_mesh)

"""Hybrid context parallelism (``ulysses_ring``): Ulysses' all-to-all over the inner CP ranks, then the masked ring
over the outer ones for that share of the heads.

The CP ranks form a ring degree x ulysses degree grid, the Ulysses ranks neighbours (rank = ring index x u + ulysses
index: within a node where CP fits one). Every rank holds its own positions of the sequence, T / cp of them.
Around each attention kernel:

1. an all-to-all over the rank's u Ulysses peers (``ulysses.sequence_to_heads``) turns (all heads, its positions)
   into (H / u heads, the group's u x T / cp positions in peer order): the group's queries, keys and values for
   this rank's heads; key/value heads fewer than u are repeated first, as Ulysses does;
2. the masked ring (``masked_ring``) over the rank's r ring peers (the ranks of the other groups with the same
   Ulysses index, so with the same heads): the group's queries meet every group's keys and values one group at a
   time, under the mask of the group's queries over all keys (ring order: group i's positions are columns
   i S / r .. (i + 1) S / r - 1), blocks the mask leaves empty neither computed nor sent, sinks cut to the heads;
3. the reverse all-to-all back to (all heads, its positions).

So the positions are a ring-level order: ``order.view(r, -1)[i]`` are group i's, cut contiguously among its u
members (``order.view(cp, -1)[rank]``, the tokens a rank holds). Any order is exact; a causal mask is given to
the ring as a mask like any other. A rank's K/V memory is O(S / r / u x u) = O(S / r) rows of H / u heads:
O(S / cp) elements.

Gated DeltaNet layers (build.py wires them) take the same two steps with their own code: the all-to-all of
linear_attention_ulysses.py over the u peers, then linear_attention_cp.py's scan over the r groups, which needs
the positions head-tail over the groups (the step orders Gated DeltaNet families so).
"""

from __future__ import annotations

import types
import weakref

import torch
from torch import Tensor

from titanctl.errors import ParallelError
from titanctl.models.common.attention import AttentionKernel
from titanctl.parallel.layouts.masked_ring import RingPeers, masked_ring_attention
from titanctl.parallel.layouts.ulysses import (
    HEAD_DIM,
    _AllToAll,
    heads_to_sequence,
    repeat_kv_heads,
    sequence_to_heads,
)


def check_ulysses_ring(cp: int, ulysses: int, n_heads: int | None = None, tp: int = 1) -> int:
    """The ring degree cp / ulysses; raises in one line unless the Ulysses degree divides cp (leaving a ring of at
    least 2: otherwise it is plain Ulysses) and, given ``n_heads``, the heads after TP."""
    if ulysses < 2 or cp % ulysses or cp == ulysses:
        raise ParallelError(
            f"context_parallel_method = ulysses_ring needs context_parallel_ulysses_degree >= 2 dividing "
            f"context_parallel_degree = {cp} and smaller than it, got {ulysses} (use ulysses for all of cp)"
        )
    if n_heads is not None and n_heads % (tp * ulysses):
        raise ParallelError(
            f"ulysses_ring context parallel splits the heads over the Ulysses ranks: n_heads = {n_heads} is not "
            f"divisible by tensor_parallel_degree x context_parallel_ulysses_degree = {tp} x {ulysses}"
        )
    return cp // ulysses


@torch.compiler.disable  # all-to-alls and point-to-point sends inside: a compiled block runs this call eagerly
def ulysses_ring_attention(q: Tensor, k: Tensor, v: Tensor, mask, *, all_to_all, ulysses: int, ulysses_rank: int,
                           ring_peers, sinks: Tensor | None = None) -> Tensor:
    """This rank's attention output (B, H, T / cp, d) of its q, k, v (B, heads, T / cp, d): ``all_to_all`` over its
    ``ulysses`` Ulysses peers (it is ``ulysses_rank`` among them; an autograd all-to-all of dim 0), the masked ring
    over ``ring_peers`` under ``mask`` (B or 1, 1, u T / cp, T): the group's queries over all keys, ring order."""
    heads = q.shape[HEAD_DIM]
    k, v = repeat_kv_heads(k, heads, ulysses), repeat_kv_heads(v, heads, ulysses)
    q, k, v = (sequence_to_heads(t, None, ulysses, all_to_all) for t in (q, k, v))  # (B, H / u, u T / cp, d)
    if sinks is not None:  # one logit per head: this rank's heads'
        sinks = sinks.view(ulysses, -1)[ulysses_rank]
    out = masked_ring_attention(q, k, v, mask, ring_peers, sinks)
    return heads_to_sequence(out, None, ulysses, all_to_all)


_HYBRID_KERNELS: weakref.WeakSet = weakref.WeakSet()  # the attention kernels routed already


def enable_ulysses_ring(model: torch.nn.Module, ulysses_mesh, ring_mesh) -> None:
    """Route every attention kernel of ``model`` through ``ulysses_ring_attention`` over the CP mesh's two dims
    (idempotent). Every call needs its mask (titanctl/train/attention_masks.py builds causal ones too)."""
    group, ulysses, ulysses_rank = ulysses_mesh.get_group(), ulysses_mesh.size(), ulysses_mesh.get_local_rank()
    ring_peers = RingPeers(ring_mesh.get_group())

    def all_to_all(x: Tensor) -> Tensor:
        return _AllToAll.apply(x, group)

    def forward(self, q, k, v, mask=None, **inputs):
        if mask is None:
            raise ValueError("ulysses_ring attention needs the mask of its group's queries over all keys")
        sinks = inputs.pop("sinks", None)
        if inputs:
            raise NotImplementedError(f"ulysses_ring attention takes sinks only, not {', '.join(inputs)}")
        return ulysses_ring_attention(q, k, v, mask, all_to_all=all_to_all, ulysses=ulysses,
                                      ulysses_rank=ulysses_rank, ring_peers=ring_peers, sinks=sinks)

    for module in model.modules():
        if isinstance(module, AttentionKernel) and module not in _HYBRID_KERNELS:
            module.forward = types.MethodType(forward, module)
            _HYBRID_KERNELS.add(module)

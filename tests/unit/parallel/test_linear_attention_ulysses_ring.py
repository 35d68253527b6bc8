"""Gated DeltaNet under ulysses_ring (linear_attention_ulysses.py's all-to-all over the Ulysses peers, then
linear_attention_cp.py's scan over the ring groups) is exact: a layer run as cp = ring x ulysses thread ranks, the
positions head-tail over the ring groups (as the step orders them for Gated DeltaNet families) and the mask the
step hands the layer (by layer type: the full layers' RingMask of the group's queries), equals the layer over the
whole sequence in fp64, outputs and every parameter's and input's gradient, causal and with documents crossing the
groups' chunks and the ranks' shares. tests/distributed/test_hybrid_layouts.py runs it on gloo in training."""

from __future__ import annotations

import pytest
import torch

from tests.unit.parallel.test_linear_attention_cp import assert_split_equals_whole, layer
from tests.unit.parallel.thread_ranks import FakeMesh, ThreadAllToAll, ThreadGather, run_ranks
from titanctl.models.common.document_mask import dense_document_mask
from titanctl.models.common.gated_deltanet import GatedDeltaNet
from titanctl.parallel.layouts.context_parallel import load_balanced_order
from titanctl.parallel.layouts.linear_attention_cp import GatedDeltaNetScan
from titanctl.parallel.layouts.linear_attention_ulysses import GatedDeltaNetHeads
from titanctl.parallel.layouts.ring_mask import RingMask, document_start_positions

SEQ = 32


class _Barriers:
    """Every group's barriers, aborted together when one rank fails (run_ranks aborts the one it is given)."""

    def __init__(self, exchanges):
        self.barriers = [e.barrier for e in exchanges]

    def abort(self) -> None:
        for b in self.barriers:
            b.abort()


def hybrid_run(gdn: GatedDeltaNet, x: torch.Tensor, doc_ids: torch.Tensor | None, ring: int,
               ulysses: int) -> torch.Tensor:
    """The layer's output (B, T, dim) over ring x ulysses simulated ranks (rank g u + j: group g, Ulysses index j),
    put back in sequence order."""
    cp = ring * ulysses
    order = load_balanced_order(SEQ, ring)  # group g: chunks g and 2r-1-g, cut contiguously among its members
    starts = document_start_positions(doc_ids, SEQ)
    all_to_alls = [ThreadAllToAll(ulysses) for _ in range(ring)]  # within each group
    gathers = [ThreadGather(ring) for _ in range(ulysses)]  # across the groups, per Ulysses index
    outs: list = [None] * cp

    def rank(flat: int) -> None:
        g, j = divmod(flat, ulysses)
        heads = GatedDeltaNetHeads.__new__(GatedDeltaNetHeads)
        heads.cp, heads.rank = ulysses, j
        heads._all_to_all = lambda chunks: all_to_alls[g](j, chunks)
        scan = GatedDeltaNetScan(FakeMesh(ring, g))
        scan._gather = lambda pieces: gathers[j](g, pieces)
        clone = object.__new__(GatedDeltaNet)  # the same parameters, this thread's exchange and scan
        clone.__dict__ = dict(gdn.__dict__)
        clone.head_exchange, clone.sequence_scan = heads, scan
        mask = {"full_attention": RingMask(starts, order.view(ring, -1)[g], order, ring)}
        outs[flat] = clone(x[:, order.view(cp, -1)[flat]], attn_mask=mask)

    run_ranks(cp, rank, _Barriers([*all_to_alls, *gathers]))
    return torch.cat(outs, dim=1)[:, torch.argsort(order)]


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_hybrid_layer_equals_the_whole_sequence(documents):
    gdn = layer()  # the debug model's 2 key heads: one per Ulysses rank
    torch.manual_seed(1)
    x = torch.randn(2, SEQ, 64, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, SEQ, 64, dtype=torch.float64)
    doc_ids = None
    if documents:  # chunks of 8 tokens (ring 2), shares of 4 (cp 4): starts inside both and on their first tokens
        starts = torch.zeros(2, SEQ, dtype=torch.long)
        starts[0, [0, 5, 16, 27]] = 1
        starts[1, [0, 8, 10, 25]] = 1
        doc_ids = starts.cumsum(1)

    assert_split_equals_whole(gdn, x, weights, None if doc_ids is None else dense_document_mask(doc_ids),
                              lambda: hybrid_run(gdn, x, doc_ids, ring=2, ulysses=2))


def test_the_step_orders_every_family_head_tail_over_the_ring_groups():
    """Under ulysses_ring positions are head-tail over the cp / u groups: the scan's chunks for a Gated DeltaNet
    family (qwen3_5_moe, the same layer, like qwen3_5), sorted positions a group for the masked ring's blocks."""
    from tests.conftest import REPO
    from titanctl.config.recipe import load_config
    from titanctl.models.registry import model_args_from_config
    from titanctl.parallel.layouts.build import check_layout
    from titanctl.parallel.layouts.dims import ParallelDims
    from titanctl.train.attention_masks import MicrobatchMasks

    hybrid = ["--parallelism.context_parallel_degree", "4", "--parallelism.context_parallel_method", "ulysses_ring",
              "--parallelism.context_parallel_ulysses_degree", "2", "--training.seq_len", "64", "--compile.enable", "false"]
    tokens = torch.zeros(1, 64, dtype=torch.long)
    for recipe in ("qwen3_5_debug", "qwen3_5_moe_debug", "llama3_debug"):
        cfg = load_config(REPO / "recipes" / f"{recipe}.toml", hybrid)
        args = model_args_from_config(cfg.model, 256, 64)
        dims = ParallelDims.from_config(cfg.parallelism, 4)
        check_layout(cfg, dims, args)  # no refusal for the Gated DeltaNet families
        dims.__dict__["mesh"] = {"cp_ring": FakeMesh(2, 0)}  # (a cached property: no process group here)
        part = torch.nn.Module()
        part.args = args
        masks = MicrobatchMasks.build(cfg, dims, None, [part])
        assert torch.equal(masks.cp_order(tokens), load_balanced_order(64, 2)), recipe

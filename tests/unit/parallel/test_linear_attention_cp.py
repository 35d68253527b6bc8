"""Gated DeltaNet context parallel (titanctl/parallel/layouts/linear_attention_cp.py) is exact: a layer run as
cp ranks, each holding its two head-tail chunks and passing conv tails and chunk maps to the others, equals
the layer over the whole sequence in fp64, outputs and every parameter's and input's gradient, causal and with
documents that cross the ranks' chunks. The ranks are threads of this process, and the all-gather a cat of
their pieces (one autograd graph, one backward), so what is checked is the scan itself; the torchrun worlds
(tests/distributed/test_hybrid_layouts.py) check it on gloo inside training."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.unit.parallel.thread_ranks import FakeMesh, ThreadGather, run_ranks
from titanctl.errors import ParallelError
from titanctl.models.common.document_mask import dense_document_mask
from titanctl.models.common.gated_deltanet import GatedDeltaNet
from titanctl.models.qwen3_5.args import QWEN3_5_FLAVORS
from titanctl.parallel.layouts.context_parallel import load_balanced_order
from titanctl.parallel.layouts.linear_attention_cp import GatedDeltaNetScan
from titanctl.parallel.layouts.ring_mask import RingMask, document_start_positions

SEQ = 32


def layer(**heads) -> GatedDeltaNet:
    """The debug model's Gated DeltaNet at dim 64 in fp64 (``heads``: other LinearAttentionArgs fields)."""
    torch.manual_seed(0)
    args = QWEN3_5_FLAVORS["debugmodel"]
    args = args.replace(dim=64, linear_attention=dataclasses.replace(args.linear_attention, **heads))
    gdn = GatedDeltaNet(args).double()
    with torch.no_grad():
        for p in gdn.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() == 1 else p.shape[-1] ** -0.5))
        gdn.a_log.uniform_(-1.0, 1.0)  # decays between fast and slow
    return gdn


def sharded_run(gdn: GatedDeltaNet, x: torch.Tensor, doc_ids: torch.Tensor | None, cp: int) -> torch.Tensor:
    """The layer's output (B, T, dim) over cp simulated ranks, put back in sequence order."""
    order = load_balanced_order(SEQ, cp)
    mine = order.view(cp, -1)
    gather = ThreadGather(cp)
    outs: list = [None] * cp

    def rank(r: int) -> None:
        scan = GatedDeltaNetScan(FakeMesh(cp, r))
        scan._gather = lambda pieces: gather(r, pieces)
        if doc_ids is None:
            mask = None
        elif cp == 4:  # the mask training hands it (documents' starts), at CP 2 a dense one
            mask = RingMask(document_start_positions(doc_ids, SEQ), mine[r], order, cp)
        else:
            mask = dense_document_mask(doc_ids, q_positions=mine[r], kv_positions=order)
        outs[r] = _with_scan(gdn, scan)(x[:, mine[r]], attn_mask=mask)

    run_ranks(cp, rank, gather.barrier)
    return torch.cat(outs, dim=1)[:, torch.argsort(order)]  # (B, T, dim) in sequence order


def assert_split_equals_whole(gdn: GatedDeltaNet, x, weights, whole_mask, split) -> torch.Tensor:
    """``split`` (the layer run over thread ranks) equals the layer over the whole sequence under ``whole_mask``:
    the output to 1e-12 and the gradients of x and every parameter to 1e-11, relative to each's largest. Returns
    the whole sequence's output."""
    whole = gdn(x, attn_mask=whole_mask)
    grads = torch.autograd.grad((whole * weights).sum(), [x, *gdn.parameters()])
    out = split()
    split_grads = torch.autograd.grad((out * weights).sum(), [x, *gdn.parameters()])
    assert (out - whole).abs().max() <= 1e-12 * whole.abs().max()
    names = ["x", *(n for n, _ in gdn.named_parameters())]
    for name, a, b in zip(names, grads, split_grads):
        assert (a - b).abs().max() <= 1e-11 * a.abs().max(), name
    return whole


def _with_scan(gdn: GatedDeltaNet, scan: GatedDeltaNetScan) -> GatedDeltaNet:
    """A shallow copy of gdn (the same parameters) with this thread's scan: the threads share the module."""
    clone = object.__new__(GatedDeltaNet)
    clone.__dict__ = dict(gdn.__dict__)
    clone.sequence_scan = scan
    return clone


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_sharded_layer_equals_the_whole_sequence(cp, documents):
    gdn = layer()
    torch.manual_seed(1)
    x = torch.randn(2, SEQ, 64, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, SEQ, 64, dtype=torch.float64)
    doc_ids = None
    if documents:  # starts at 0, inside chunks and on a chunk's first token (chunks of 16 / 8 tokens)
        starts = torch.zeros(2, SEQ, dtype=torch.long)
        starts[0, [0, 5, 16, 27]] = 1
        starts[1, [0, 9, 10, 24]] = 1
        doc_ids = starts.cumsum(1)

    whole = assert_split_equals_whole(gdn, x, weights, None if doc_ids is None else dense_document_mask(doc_ids),
                                      lambda: sharded_run(gdn, x, doc_ids, cp))
    if not documents:  # the state and the halo matter: pieces run alone (no scan) give other outputs
        alone = torch.cat([gdn(x[:, i * SEQ // cp:(i + 1) * SEQ // cp]) for i in range(cp)], dim=1)
        assert (alone - whole).abs().max() > 1e-3 * whole.abs().max()


def test_chunks_shorter_than_the_conv_halo_are_refused():
    scan = GatedDeltaNetScan(FakeMesh(4, 0))
    with pytest.raises(ParallelError, match="must hold the conv's 3 earlier inputs"):
        scan.conv(torch.zeros(1, 4, 8), torch.zeros(8, 1, 4), None)


def test_a_layout_with_chunks_shorter_than_the_halo_is_refused_before_training():
    from titanctl.config.recipe import load_config
    from titanctl.models.registry import model_args_from_config
    from titanctl.parallel.layouts.build import check_layout
    from titanctl.parallel.layouts.dims import ParallelDims

    def check(seq_len: int) -> None:
        cfg = load_config(None, ["--model.name", "qwen3_5", "--model.flavor", "debugmodel",
                                 "--parallelism.context_parallel_degree", "4", "--training.seq_len", str(seq_len)])
        check_layout(cfg, ParallelDims.from_config(cfg.parallelism, 4), model_args_from_config(cfg.model, 256, seq_len))

    with pytest.raises(ParallelError, match="chunks of 2 tokens, fewer than the 3 earlier inputs"):
        check(16)
    check(24)  # chunks of 3: enough

"""Ulysses for Gated DeltaNet (titanctl/parallel/layouts/linear_attention_ulysses.py) is exact: a layer run as cp
ranks, each holding a contiguous 1/cp of the sequence and trading it by all-to-all for every position of its
share of the key-head groups, equals the layer over the whole sequence in fp64, outputs and every parameter's
and input's gradient, causal and with documents (the one-process mask, as Ulysses hands it). The ranks are
threads and the all-to-all a stack of their chunks (one autograd graph), so what is checked is the exchange and
the cut of the per-head parameters; tests/distributed/test_hybrid_layouts.py runs it on gloo in training."""

from __future__ import annotations

import pytest
import torch

from tests.unit.parallel.test_linear_attention_cp import assert_split_equals_whole, layer
from tests.unit.parallel.thread_ranks import ThreadAllToAll, run_ranks
from titanctl.errors import ParallelError
from titanctl.models.common.document_mask import dense_document_mask
from titanctl.models.common.gated_deltanet import GatedDeltaNet
from titanctl.parallel.layouts.linear_attention_ulysses import GatedDeltaNetHeads

SEQ = 32


def _with_exchange(gdn: GatedDeltaNet, heads: GatedDeltaNetHeads) -> GatedDeltaNet:
    """A shallow copy of gdn (the same parameters) with this thread's exchange: the threads share the module."""
    clone = object.__new__(GatedDeltaNet)
    clone.__dict__ = dict(gdn.__dict__)
    clone.head_exchange = heads
    return clone


def ulysses_run(gdn, x: torch.Tensor, mask: torch.Tensor | None, cp: int) -> torch.Tensor:
    """The layer's output (B, T, dim) over cp simulated Ulysses ranks (rank r: positions r T / cp ..)."""
    exchange = ThreadAllToAll(cp)
    outs: list = [None] * cp
    share = SEQ // cp

    def rank(r: int) -> None:
        heads = GatedDeltaNetHeads.__new__(GatedDeltaNetHeads)
        heads.cp, heads.rank = cp, r
        heads._all_to_all = lambda chunks: exchange(r, chunks)
        outs[r] = _with_exchange(gdn, heads)(x[:, r * share:(r + 1) * share], attn_mask=mask)

    run_ranks(cp, rank, exchange.barrier)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize(("cp", "key_heads"), [(2, 2), (4, 4)])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_ulysses_layer_equals_the_whole_sequence(cp, key_heads, documents):
    gdn = layer(num_key_heads=key_heads, num_value_heads=2 * key_heads)
    torch.manual_seed(1)
    x = torch.randn(2, SEQ, 64, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, SEQ, 64, dtype=torch.float64)
    mask = None
    if documents:  # starts inside a rank's share and on a share's first token
        starts = torch.zeros(2, SEQ, dtype=torch.long)
        starts[0, [0, 5, 16, 27]] = 1
        starts[1, [0, 8, 9, 24]] = 1
        mask = dense_document_mask(starts.cumsum(1))

    assert_split_equals_whole(gdn, x, weights, mask, lambda: ulysses_run(gdn, x, mask, cp))


def test_key_heads_that_do_not_split_are_refused_before_training():
    from titanctl.config.recipe import load_config
    from titanctl.models.registry import model_args_from_config
    from titanctl.parallel.layouts.build import check_layout
    from titanctl.parallel.layouts.dims import ParallelDims

    cfg = load_config(None, ["--model.name", "qwen3_5", "--model.flavor", "debugmodel", "--training.seq_len", "64",
                             "--parallelism.context_parallel_degree", "4",
                             "--parallelism.context_parallel_method", "ulysses"])
    with pytest.raises(ParallelError) as refused:
        check_layout(cfg, ParallelDims.from_config(cfg.parallelism, 4), model_args_from_config(cfg.model, 256, 64))
    assert str(refused.value) == (
        "ulysses context parallel splits the Gated DeltaNet layers by key heads: linear_attention.num_key_heads = 2 "
        "is not divisible by tensor_parallel_degree x context_parallel_degree = 1 x 4; use context_parallel_method = "
        "ring")

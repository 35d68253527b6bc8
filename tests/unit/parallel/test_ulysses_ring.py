"""The hybrid context parallel attention (titanctl/parallel/layouts/ulysses_ring.py) is exact: cp = ring x ulysses
ranks, each holding its positions of the sequence in any order, give the attention over the whole sequence in fp64
to ~1e-12, outputs and the gradients of q, k, v and the sinks, under causal, document and sliding-window masks,
with grouped-query heads (repeated where fewer than the Ulysses degree). The ranks are threads of this process:
all-to-alls through shared slots, the ring's sends through the masked ring test's mailboxes."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.unit.parallel.test_masked_ring import (
    BATCH,
    DIM,
    HEADS,
    SEQ,
    ThreadPeers,
    ThreadWorld,
    assemble,
    full_attention,
    the_mask,
)
from tests.unit.parallel.thread_ranks import run_ranks
from titanctl.errors import ParallelError
from titanctl.parallel.layouts.ulysses_ring import check_ulysses_ring, ulysses_ring_attention


class ThreadAllToAll:
    """u threads' all-to-all of dim 0: peer p's chunk r goes to peer r, as chunk p."""

    def __init__(self, u: int, barrier: threading.Barrier):
        self.barrier, self.slots = barrier, [None] * u

    def swap(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = x
        self.barrier.wait()
        out = torch.stack([self.slots[p][rank] for p in range(len(self.slots))])
        self.barrier.wait()
        return out


class _Swap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, exchange, rank):
        ctx.exchange, ctx.rank = exchange, rank
        return exchange.swap(rank, x.detach().clone())

    @staticmethod
    def backward(ctx, grad):
        return ctx.exchange.swap(ctx.rank, grad.contiguous()), None, None


def hybrid_run(q, k, v, mask, sinks, ring: int, ulysses: int, order: torch.Tensor):
    cp = ring * ulysses
    barrier = threading.Barrier(cp, timeout=30)  # aborted by run_ranks if a rank fails
    groups = [ThreadAllToAll(ulysses, threading.Barrier(ulysses, timeout=30)) for _ in range(ring)]
    rings = [ThreadWorld(ring) for _ in range(ulysses)]  # the ranks with the same Ulysses index
    grad_out = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    results: list = [None] * cp

    def rank(r: int) -> None:
        i, j = divmod(r, ulysses)
        mine = order.view(cp, -1)[r]
        group = order.view(ring, -1)[i]
        q_r, k_r, v_r = (t[:, :, mine].detach().clone().requires_grad_() for t in (q, k, v))
        s_r = None if sinks is None else sinks.detach().clone().requires_grad_()
        out = ulysses_ring_attention(
            q_r, k_r, v_r, mask[:, :, group][..., order], all_to_all=lambda x: _Swap.apply(x, groups[i], j),
            ulysses=ulysses, ulysses_rank=j, ring_peers=ThreadPeers(rings[j], i), sinks=s_r,
        )
        out.backward(grad_out[:, :, mine])
        results[r] = (out.detach(), q_r.grad, k_r.grad, v_r.grad, None if s_r is None else s_r.grad)

    run_ranks(cp, rank, barrier)
    return results, grad_out


@pytest.mark.parametrize(
    ("kind", "ring", "ulysses", "kv_heads", "sinks"),
    [
        ("causal", 2, 2, 2, False),
        ("documents", 2, 2, 1, False),  # one KV head repeated to the 2 Ulysses ranks
        ("window", 4, 2, 2, True),
        ("documents+window", 2, 4, 2, True),  # 2 KV heads repeated to 4
    ],
)
def test_equals_full_attention_fp64(kind, ring, ulysses, kv_heads, sinks):
    torch.manual_seed(0)
    q = torch.randn(BATCH, HEADS, SEQ, DIM, dtype=torch.float64, requires_grad=True)
    k = torch.randn(BATCH, kv_heads, SEQ, DIM, dtype=torch.float64, requires_grad=True)
    v = torch.randn(BATCH, kv_heads, SEQ, DIM, dtype=torch.float64, requires_grad=True)
    s = torch.randn(HEADS, dtype=torch.float64, requires_grad=True) if sinks else None
    mask, order = the_mask(kind), torch.randperm(SEQ)  # any partition of the positions
    results, grad_out = hybrid_run(q, k, v, mask, s, ring, ulysses, order)
    ref = full_attention(q, k, v, mask, s)
    ref.backward(grad_out)
    assert (assemble(results, 0, order, ref.detach()) - ref).abs().max() < 1e-12
    for index, leaf in ((1, q), (2, k), (3, v)):
        assert (assemble(results, index, order, leaf.grad) - leaf.grad).abs().max() < 1e-12
    if sinks:  # each rank's share of its heads' sinks: the CP ranks' sum is the whole gradient
        assert (sum(r[4] for r in results) - s.grad).abs().max() < 1e-12


@pytest.mark.parametrize(("heads", "tp", "cp", "ulysses", "message"), [
    (8, 1, 4, 3, "context_parallel_ulysses_degree >= 2 dividing context_parallel_degree = 4 and smaller than it"),
    (8, 1, 4, 4, "and smaller than it, got 4"),
    (6, 2, 4, 2, "n_heads = 6 is not divisible by tensor_parallel_degree x context_parallel_ulysses_degree = 2 x 2"),
])
def test_refusals_in_one_line(heads, tp, cp, ulysses, message):
    with pytest.raises(ParallelError, match=message) as e:
        check_ulysses_ring(cp, ulysses, heads, tp)
    assert "\n" not in str(e.value)
    assert check_ulysses_ring(8, 2, 8, 2) == 4


def test_the_config_refuses_a_ulysses_degree_elsewhere_and_reads_it_as_mesh_dims():
    from titanctl.config.job_config import Parallelism
    from titanctl.parallel.layouts.dims import ParallelDims

    p = Parallelism(context_parallel_degree=4, context_parallel_ulysses_degree=2)
    with pytest.raises(ParallelError, match="context_parallel_ulysses_degree = 2 needs context_parallel_method = "
                                            "ulysses_ring, not ring"):
        ParallelDims.from_config(p, 4)
    p.context_parallel_method = "ulysses_ring"
    dims = ParallelDims.from_config(p, 8)
    assert (dims.cp, dims.cp_ulysses, dims.dp_shard) == (4, 2, 2)
    p.context_parallel_ulysses_degree = 1
    with pytest.raises(ParallelError, match="needs context_parallel_ulysses_degree >= 2"):
        ParallelDims.from_config(p, 8)


def test_check_layout_refuses_heads_that_do_not_split():
    from tests.conftest import REPO
    from titanctl.config.recipe import load_config
    from titanctl.models.registry import model_args_from_config
    from titanctl.parallel.layouts.build import check_layout
    from titanctl.parallel.layouts.dims import ParallelDims

    cfg = load_config(REPO / "recipes" / "llama3_debug.toml", [
        "--parallelism.context_parallel_degree", "8", "--parallelism.tensor_parallel_degree", "2",
        "--parallelism.context_parallel_method", "ulysses_ring", "--parallelism.context_parallel_ulysses_degree", "4",
        "--training.seq_len", "64"])
    args = model_args_from_config(cfg.model, 2048, 64)  # 8 heads: TP 2 x Ulysses 4 leaves 1 each, fine
    cfg.compile.enable = True
    with pytest.raises(ParallelError, match="ulysses_ring does not run under compile.enable") as e:
        check_layout(cfg, ParallelDims.from_config(cfg.parallelism, 16), args)
    assert "\n" not in str(e.value)
    cfg.compile.enable = False
    check_layout(cfg, ParallelDims.from_config(cfg.parallelism, 16), args)
    cfg.parallelism.context_parallel_degree, cfg.parallelism.context_parallel_ulysses_degree = 16, 8
    with pytest.raises(ParallelError, match="n_heads = 8 is not divisible by tensor_parallel_degree x "
                                            "context_parallel_ulysses_degree = 2 x 8"):
        check_layout(cfg, ParallelDims.from_config(cfg.parallelism, 32), args)


def test_check_layout_refuses_gated_deltanet_layouts_that_cannot_hold():
    """Gated DeltaNet layers run under the hybrid (tests/unit/parallel/test_linear_attention_ulysses_ring.py); what
    cannot hold is refused in one line before any rank connects (and so never proposed by `titanctl plan`, which
    asks check_layout): key heads after TP not divisible by the Ulysses degree, ring chunks shorter than the conv's
    halo."""
    from tests.conftest import REPO
    from titanctl.config.recipe import load_config
    from titanctl.models.registry import model_args_from_config
    from titanctl.parallel.layouts.build import check_layout
    from titanctl.parallel.layouts.dims import ParallelDims

    def check(cp: int, ulysses: int, seq_len: int) -> None:
        cfg = load_config(REPO / "recipes" / "qwen3_5_debug.toml", [
            "--parallelism.context_parallel_degree", str(cp), "--parallelism.context_parallel_method", "ulysses_ring",
            "--parallelism.context_parallel_ulysses_degree", str(ulysses), "--training.seq_len", str(seq_len),
            "--compile.enable", "false"])
        check_layout(cfg, ParallelDims.from_config(cfg.parallelism, cp), model_args_from_config(cfg.model, 2048, seq_len))

    check(4, 2, 64)  # the debug model's 2 key heads, one per Ulysses rank; ring chunks of 16
    for cp, ulysses, seq_len, message in (
            (8, 4, 64, "linear_attention.num_key_heads = 2 is not divisible by tensor_parallel_degree x "
                       "context_parallel_ulysses_degree = 1 x 4; use context_parallel_method = ring"),
            (4, 2, 8, "context_parallel_degree / context_parallel_ulysses_degree = 2 cuts training.seq_len 8 into "
                      "chunks of 2 tokens, fewer than the 3 earlier inputs")):
        with pytest.raises(ParallelError, match=message) as e:
            check(cp, ulysses, seq_len)
        assert "\n" not in str(e.value)

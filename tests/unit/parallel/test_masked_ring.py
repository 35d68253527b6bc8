"""Masked ring attention (titanctl/parallel/layouts/masked_ring.py) is exact: cp ranks, each holding its queries
and its shard of keys and values at arbitrary positions of the sequence, fetching the other shards one at a time,
give the attention over the whole sequence in fp64 to ~1e-12, outputs and the gradients of q, k, v and the sinks,
under documents, sliding windows and gpt-oss's sinks, with grouped-query heads and MLA's narrower values. The ranks
are threads of this process and the point-to-point sends go through mailboxes that count what was sent, so the
test also sees that blocks the mask leaves empty are never sent; the torchrun worlds run it on gloo in training."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from tests.unit.parallel.thread_ranks import run_ranks
from titanctl.models.common import softmax_blocks
from titanctl.models.common.document_mask import dense_document_mask
from titanctl.parallel.layouts import masked_ring
from titanctl.parallel.layouts.masked_ring import masked_ring_attention
from titanctl.parallel.layouts.ring_mask import RingMask, document_start_positions

SEQ, BATCH, HEADS, KV_HEADS, DIM = 32, 2, 4, 2, 8


class ThreadPeers:
    """cp threads as CP ranks: mailboxes per (sender, receiver) and a barrier for the all-gather."""

    def __init__(self, world: ThreadWorld, rank: int):
        self.world, self.rank, self.size = world, rank, world.cp

    def gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        self.world.rows[self.rank] = row
        self.world.barrier.wait()
        table = torch.stack(self.world.rows)
        self.world.barrier.wait()
        return table

    def exchange(self, send, dst, like, src):
        if send is not None:
            self.world.sent.append((self.rank, dst))
            self.world.boxes[self.rank, dst].put(send.clone())
        return None if like is None else self.world.boxes[src, self.rank].get(timeout=30)


class ThreadWorld:
    def __init__(self, cp: int):
        self.cp = cp
        self.barrier = threading.Barrier(cp, timeout=30)
        self.rows: list = [None] * cp
        self.boxes = {(a, b): queue.Queue() for a in range(cp) for b in range(cp)}
        self.sent: list = []


def full_attention(q, k, v, mask, sinks):
    """The one-process reference: the softmax written out over all keys, the sink in the denominator."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    weights = torch.softmax(scores, dim=-1)
    return weights[..., : v.shape[2]] @ v


WINDOW = 5


def the_documents(kind: str) -> torch.Tensor | None:
    """(B, T) document ids of ``kind``'s mask; None: one causal document."""
    if kind in ("causal", "window"):
        return None
    starts = torch.zeros(BATCH, SEQ, dtype=torch.long)
    starts[0, [0, 5, 13, 14, 27]] = 1  # documents shorter and longer than a shard, one of a single token
    starts[1, [0, 20]] = 1
    return starts.cumsum(1)


def the_mask(kind: str, window: int = WINDOW) -> torch.Tensor:
    """(B, 1, T, T) bool over positions in order."""
    pos = torch.arange(SEQ)
    causal = (pos[None, :] <= pos[:, None])[None, None].expand(BATCH, 1, SEQ, SEQ)
    if kind == "causal":
        return causal
    doc = causal if kind == "window" else dense_document_mask(the_documents(kind))
    if kind == "documents":
        return doc
    narrow = (pos[:, None] - pos[None, :]) < window
    return doc & narrow


def ring_mask(kind: str, mine: torch.Tensor, order: torch.Tensor, cp: int) -> RingMask:
    """``kind``'s mask of the queries at ``mine`` over the keys in ``order``, as training hands it: no dense bool."""
    starts = document_start_positions(the_documents(kind), SEQ)
    return RingMask(starts, mine, order, cp, WINDOW if "window" in kind else None)


def ring_run(q, k, v, mask, sinks, cp: int, order: torch.Tensor, kind: str | None = None):
    """Every rank's output and gradients, rank r holding positions order.view(cp, -1)[r]; and the sends. ``kind``:
    each rank gets that mask as a ``RingMask`` (else its rows of the dense ``mask``)."""
    world = ThreadWorld(cp)
    shares = order.view(cp, -1)
    grad_out = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    results: list = [None] * cp

    def rank(r: int) -> None:
        mine = shares[r]
        q_r, k_r, v_r = (t[:, :, mine].detach().clone().requires_grad_() for t in (q, k, v))
        s_r = None if sinks is None else sinks.detach().clone().requires_grad_()
        mask_r = mask[:, :, mine][..., order] if kind is None else ring_mask(kind, mine, order, cp)
        out = masked_ring_attention(q_r, k_r, v_r, mask_r, ThreadPeers(world, r), s_r)
        out.backward(grad_out[:, :, mine])
        results[r] = (out.detach(), q_r.grad, k_r.grad, v_r.grad, None if s_r is None else s_r.grad)

    run_ranks(cp, rank, world.barrier)
    return results, grad_out, world.sent


def assemble(results, index: int, order: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    parts = torch.cat([r[index] for r in results], dim=2)
    whole = torch.empty(like.shape, dtype=parts.dtype)
    whole[:, :, order] = parts
    return whole


@pytest.mark.parametrize(
    ("kind", "cp", "sinks", "order_kind", "v_dim", "fused", "form"),
    [
        ("documents", 2, False, "head_tail", DIM, True, "dense"),
        ("documents", 4, True, "shuffled", DIM, True, "ring"),
        ("window", 4, True, "contiguous", DIM, True, "ring"),
        ("documents+window", 2, True, "shuffled", DIM, True, "ring"),
        ("documents", 2, False, "contiguous", DIM // 2, True, "ring"),  # MLA: values narrower than keys
        ("documents+window", 4, True, "shuffled", DIM, False, "dense"),  # the written-out softmax of other devices
        ("documents+window", 4, False, "contiguous", DIM, True, "ring"),
    ],
)
def test_equals_full_attention_fp64(kind, cp, sinks, order_kind, v_dim, fused, form, monkeypatch):
    """form "ring": the mask each rank gets is a RingMask (documents' starts, window, order), every block made
    from it on the fly and the table of blocks read off it without a gather; "dense": its rows of the bool."""
    if not fused:
        monkeypatch.setattr(softmax_blocks, "_fused", lambda q, v: False)
    torch.manual_seed(0)
    q = torch.randn(BATCH, HEADS, SEQ, DIM, dtype=torch.float64, requires_grad=True)
    k = torch.randn(BATCH, KV_HEADS, SEQ, DIM, dtype=torch.float64, requires_grad=True)
    v = torch.randn(BATCH, KV_HEADS, SEQ, v_dim, dtype=torch.float64, requires_grad=True)
    s = torch.randn(HEADS, dtype=torch.float64, requires_grad=True) if sinks else None
    mask = the_mask(kind)
    if order_kind == "head_tail":
        chunks = torch.arange(SEQ).view(2 * cp, -1)
        order = torch.cat([torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])
    elif order_kind == "shuffled":  # any partition of the positions: nothing assumes an order
        order = torch.randperm(SEQ)
    else:
        order = torch.arange(SEQ)
    results, grad_out, sent = ring_run(q, k, v, mask, s, cp, order, kind if form == "ring" else None)
    ref = full_attention(q, k, v, mask, s)
    ref.backward(grad_out)
    assert (assemble(results, 0, order, ref.detach()) - ref).abs().max() < 1e-12
    for index, leaf in ((1, q), (2, k), (3, v)):
        assert (assemble(results, index, order, leaf.grad) - leaf.grad).abs().max() < 1e-12
    if sinks:
        assert (sum(r[4] for r in results) - s.grad).abs().max() < 1e-12
    if order_kind == "contiguous":  # rank r's shard, every send counted (forward, backward: K/V out, dK/dV back)
        shares = order.view(cp, -1)
        needed = {
            (j, r) for r in range(cp) for j in range(cp) if r != j and mask[:, :, shares[r]][..., shares[j]].any()
        }
        assert sorted(set(sent)) == sorted(needed | {(r, j) for j, r in needed})
        assert len(sent) == 3 * len(needed)
        if kind == "window":  # a 5-token window over 8-token shards reaches only the shard before
            assert needed == {(j, j + 1) for j in range(cp - 1)}


def test_refuses_a_mask_that_does_not_split():
    peers = ThreadPeers(ThreadWorld(3), 0)
    q = torch.zeros(1, 1, 4, 2)
    with pytest.raises(ValueError, match="do not split into 3 equal shards"):
        masked_ring_attention(q, q, q, torch.ones(1, 1, 4, 10, dtype=torch.bool), peers)


def test_the_table_of_blocks_is_gathered_once_per_mask():
    world = ThreadWorld(1)
    peers = ThreadPeers(world, 0)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    gathers = []
    peers.gather_rows = lambda row: gathers.append(row) or row[None]
    q = torch.randn(1, 1, 4, 2)
    for _ in range(3):
        masked_ring_attention(q, q, q, mask, peers)
    assert len(gathers) == 1 and masked_ring._TABLES[id(mask)][0]() is mask


def test_fake_tensors_count_every_block_and_move_nothing():
    """estimate-memory runs the step on fake tensors: no values to read the table off or to send, so every block
    is computed and every receive buffer allocated (no process group is touched: it has none here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    peers = masked_ring.RingPeers.__new__(masked_ring.RingPeers)
    peers.group, peers.rank, peers.size = None, 0, 2
    with FakeTensorMode():
        q = torch.randn(1, HEADS, 4, DIM, requires_grad=True)
        k = torch.randn(1, KV_HEADS, 4, DIM, requires_grad=True)
        mask = torch.ones(1, 1, 4, 8, dtype=torch.bool)
        out = masked_ring_attention(q, k, k, mask, peers, torch.zeros(HEADS, requires_grad=True))
        out.sum().backward()
    assert out.shape == q.shape and k.grad.shape == k.shape


def test_bf16_inputs_run_in_fp32_and_travel_as_bf16():
    """bf16 q, k, v (K/V sent and saved as bf16, every block in fp32) against fp64 attention of the same numbers:
    within bf16's rounding of the outputs and gradients."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(BATCH, h, SEQ, DIM).bfloat16().requires_grad_() for h in (HEADS, KV_HEADS, KV_HEADS))
    s = torch.randn(HEADS).bfloat16().requires_grad_()
    mask, order = the_mask("documents+window"), torch.randperm(SEQ)
    results, grad_out, _ = ring_run(q, k, v, mask, s, 2, order)
    assert results[0][0].dtype == results[0][2].dtype == torch.bfloat16
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, s)]
    ref = full_attention(*ref_leaves[:3], mask, ref_leaves[3])
    ref.backward(grad_out.double())
    for index, want in ((0, ref.detach()), (1, ref_leaves[0].grad), (2, ref_leaves[1].grad), (3, ref_leaves[2].grad)):
        got = assemble(results, index, order, want).double()
        assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    assert (sum(r[4].double() for r in results) - ref_leaves[3].grad).abs().max() <= 2e-2 * ref_leaves[
        3
    ].grad.abs().max()


def test_a_block_mask_gives_the_same_blocks_as_the_dense_mask():
    """Other devices hand the kernel a FlexAttention BlockMask: its mask_mod, evaluated on a shard's key indices,
    gives the dense mask's block of (this rank's queries, that shard's keys)."""
    from titanctl.models.common.document_mask import block_document_mask

    starts = torch.zeros(BATCH, SEQ, dtype=torch.long)
    starts[:, [0, 7, 20]] = 1
    doc_ids, order = starts.cumsum(1), torch.randperm(SEQ)
    mine = order.view(2, -1)[1]
    dense = masked_ring.MaskBlocks(dense_document_mask(doc_ids, mine, order), 2)
    sparse = masked_ring.MaskBlocks(block_document_mask(doc_ids, mine, order), 2)
    for j in range(2):
        assert torch.equal(sparse.block(j), dense.block(j))
    assert torch.equal(sparse.row(), dense.row())


@pytest.mark.parametrize("kind", ["causal", "documents", "window", "documents+window"])
def test_a_ring_mask_gives_the_dense_masks_blocks_and_table(kind):
    """Each block a RingMask makes, and its cp x cp table of non-empty blocks (binary searches, no gather), equal
    the dense mask's, for any order of the positions."""
    cp, dense = 4, the_mask(kind)
    for order in (torch.arange(SEQ), torch.randperm(SEQ, generator=torch.Generator().manual_seed(1))):
        shares = order.view(cp, -1)
        want = [[bool(dense[:, :, shares[r]][..., shares[j]].any()) for j in range(cp)] for r in range(cp)]
        for r in range(cp):
            mask = ring_mask(kind, shares[r], order, cp)
            assert mask.shape == (dense.shape[0] if kind in ("documents", "documents+window") else 1, 1, SEQ // cp,
                                  SEQ)
            for j in range(cp):
                assert torch.equal(mask.block(j).expand(BATCH, -1, -1, -1), dense[:, :, shares[r]][..., shares[j]])
            assert mask.table() == want
        if order.equal(torch.arange(SEQ)):
            assert any(not seen for row in want for seen in row)  # the case skips blocks


def test_a_ring_mask_is_never_gathered():
    peers = ThreadPeers(ThreadWorld(1), 0)
    peers.gather_rows = lambda row: pytest.fail("a RingMask's table needs no all-gather")
    q = torch.randn(1, 1, 4, 2)
    order = torch.arange(4)
    out = masked_ring_attention(q, q, q, RingMask(torch.zeros(1, 4, dtype=torch.long), order, order, 1), peers)
    assert torch.allclose(out, full_attention(q, q, q, the_causal(4), None))


def the_causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()[None, None]

"""Context parallel's load balance in process: the attention work per position (against the dense mask's
count), the mask-aware order (a partition into equal shares, balanced on a long-tailed document mix, head-tail
under one causal document), and its exactness: ranks that hold any order and gather the keys in it give the
one-process attention (the torchrun layouts: tests/distributed/test_document_masking.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.unit.parallel.thread_ranks import FakeMesh
from titanctl.config.recipe import load_config
from titanctl.models.common.document_mask import dense_document_mask
from titanctl.models.registry import get_spec
from titanctl.parallel.layouts.context_parallel import load_balanced_order
from titanctl.parallel.layouts.cp_balance import attention_work, imbalance, mask_aware_order, rank_work
from titanctl.train.attention_masks import MicrobatchMasks

BOS = 0


def long_tailed_documents(seq_len: int, rows: int, seed: int) -> torch.Tensor:
    """(rows, seq_len) token ids: documents of log-normal lengths (median ~400 tokens, a few thousands),
    each opened by BOS, the other tokens 1."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.ones(rows, seq_len, dtype=torch.long)
    for row in tokens:
        at = 0
        while at < seq_len:
            row[at] = BOS
            at += int(torch.empty(1).log_normal_(6.0, 1.2, generator=g).clamp(min=4))
    return tokens


def test_work_counts_the_pairs_the_dense_mask_allows():
    tokens = long_tailed_documents(48, rows=3, seed=1)
    tokens[:, 0] = 1  # a document begun in an earlier window
    tokens[0, [9, 10, 30]] = BOS  # a one-token document
    doc_ids = (tokens == BOS).cumsum(dim=1)
    mask = dense_document_mask(doc_ids)[:, 0]  # (B, T, T)
    distance = torch.arange(48)[:, None] - torch.arange(48)[None, :]
    expected = mask.sum(dim=(0, 2)) * 2 + (mask & (distance < 5)).sum(dim=(0, 2))
    torch.testing.assert_close(attention_work(doc_ids, 48, [None, None, 5]), expected.double())
    causal = attention_work(None, 48, [None])
    torch.testing.assert_close(causal, torch.arange(1, 49).double())


@pytest.mark.parametrize("cp", [2, 4])
def test_mask_aware_order_balances_a_long_tailed_mix(cp):
    head_tail, balanced = [], []
    for seed in range(4):
        tokens = long_tailed_documents(8192, rows=1, seed=seed)
        work = attention_work((tokens == BOS).cumsum(dim=1), 8192, [None])
        order = mask_aware_order(work, cp)
        assert torch.equal(order.sort().values, torch.arange(8192))  # every position, once
        head_tail.append(imbalance(rank_work(work, load_balanced_order(8192, cp), cp)))
        balanced.append(imbalance(rank_work(work, order, cp)))
    print(f"\ncp {cp}: imbalance head-tail {head_tail}, mask-aware {balanced}")
    assert all(b <= min(1.05, h) for b, h in zip(balanced, head_tail))
    assert max(head_tail) > 1.08  # the mix leaves head-tail unbalanced: the check above is not idle


def test_one_causal_document_keeps_head_tail():
    work = attention_work(None, 64, [None])
    assert torch.equal(mask_aware_order(work, 2), load_balanced_order(64, 2))
    assert imbalance(rank_work(work, load_balanced_order(64, 2), 2)) == 1.0


@pytest.mark.parametrize("balancer", ["head_tail", "mask_aware"])
@pytest.mark.parametrize("window", [None, 6])
def test_ranks_holding_the_order_give_one_process_attention(balancer, window):
    """Each rank's queries (its share of the order) over the keys gathered in that order, under the masks
    MicrobatchMasks builds for them, equal one process's attention at those positions; the key changes the
    order (mask_aware is not head-tail on this batch) and never the result."""
    cp, seq = 2, 64
    tokens = long_tailed_documents(seq, rows=2, seed=3)
    tokens[:, [5, 40, 41]] = BOS
    masks = {r: MicrobatchMasks(bos_id=BOS, cp_mesh=FakeMesh(cp, r), cp=cp, balancer=balancer,
                                window=window, spans=window is not None,
                                windows=(None,) if window is None else (None, window)) for r in range(cp)}
    order = masks[0].cp_order(tokens)
    assert torch.equal(order, masks[1].cp_order(tokens))  # every rank chooses the same
    assert torch.equal(order, load_balanced_order(seq, cp)) == (balancer == "head_tail")
    q, k, v = torch.randn(3, 2, 2, seq, 4, dtype=torch.float64).unbind(0)  # (B, H, T, head_dim) each
    full = MicrobatchMasks(bos_id=BOS)(tokens).dense()  # one process's document mask (a SpanMask on CPU)
    if window is not None:  # one process narrows the causal/document mask per layer itself
        distance = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]
        full = {"full_attention": full, "sliding_attention": full & (distance < window)}
    for kind in (["full_attention", "sliding_attention"] if window else [None]):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=full[kind] if kind else full)
        got = torch.empty_like(expected)
        for r in range(cp):
            mine = order.view(cp, -1)[r]
            mask = masks[r](tokens, None, order)
            mask = mask[kind] if kind else mask  # a RingMask: its blocks side by side are the rank's rows
            rows = torch.cat([mask.block(j) for j in range(cp)], dim=-1)
            got[:, :, mine] = F.scaled_dot_product_attention(
                q[:, :, mine], k[:, :, order], v[:, :, order], attn_mask=rows)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    work = masks[0].rank_work(tokens, None, order)
    assert work.sum() == masks[0].work(tokens).sum()
    if balancer == "mask_aware":
        assert imbalance(work) <= imbalance(masks[0].rank_work(tokens, None, None))


def test_gated_deltanet_families_keep_head_tail():
    """Their scan passes state between head-tail's two chunks a rank (linear_attention_cp.py)."""
    cfg = load_config(None, ["--parallelism.context_parallel_load_balancer", "mask_aware"])
    part = SimpleNamespace(args=get_spec("qwen3_5").flavors["debugmodel"])
    assert MicrobatchMasks.build(cfg, SimpleNamespace(cp=1), None, [part]).balancer == "head_tail"
    llama = SimpleNamespace(args=get_spec("llama3").flavors["debugmodel"])
    masks = MicrobatchMasks.build(cfg, SimpleNamespace(cp=1), None, [llama])
    assert masks.balancer == "mask_aware" and masks.windows == (None,) * llama.args.n_layers


def test_estimate_memorys_fake_batches_keep_head_tail():
    """estimate-memory runs the step on fake token ids (shapes, no values): no order can be read off them, and
    every order gives the same shapes, so the step takes head-tail and logs no imbalance."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    masks = MicrobatchMasks(bos_id=None, cp_mesh=FakeMesh(2, 0), cp=2, balancer="mask_aware", window=4, spans=True,
                            windows=(None, 4))
    with FakeTensorMode():
        fake = torch.randint(0, 9, (1, 64))
        order = masks.cp_order(fake)  # reading the work off fake ids would raise DataDependentOutputException
    assert order.shape == (64,)

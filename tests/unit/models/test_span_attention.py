"""Attention under a SpanMask (documents, windows, sinks kept as the documents' starts): fp64 forward and every
gradient equal to dense SDPA under the dense mask, with chunks that attend only their keys' span."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from titanctl.models.common import softmax_blocks
from titanctl.models.common.document_mask import dense_document_mask
from titanctl.models.common.span_attention import span_attention
from titanctl.models.common.span_mask import SpanMask

SEQ, ROWS = 24, 5  # chunks of 5 queries: boundaries at 5, 10, 15, 20 fall inside documents
# row 0: documents at 0, 3, 15 (the second, 12 long, spans three chunks); row 1: at 0, 10, 11, 20
DOC_STARTS = ((0, 3, 15), (0, 10, 11, 20))


def doc_ids() -> torch.Tensor:
    ids = torch.zeros(len(DOC_STARTS), SEQ, dtype=torch.long)
    for row, starts in enumerate(DOC_STARTS):
        for s in starts[1:]:
            ids[row, s:] += 1
    return ids


def dense_reference(q, k, v, mask: torch.Tensor, sinks=None):
    """The softmax written out in fp64 over the dense bool mask (B or 1, 1, T, T), the sink in the denominator."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask) if q.shape[-1] == v.shape[-1] else (
            torch.softmax(((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5).masked_fill(~mask, -torch.inf), -1) @ v)
    scores = ((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5).masked_fill(~mask, -torch.inf)
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1] @ v


CASES = {  # name: (documents, window, query heads, key/value heads, value width, sinks)
    "documents": (True, None, 2, 2, 6, False),
    "window": (False, 4, 2, 2, 6, False),
    "documents+window+gqa": (True, 4, 4, 2, 6, False),
    "documents+mla": (True, None, 2, 2, 4, False),  # values narrower than keys (DeepSeek-V3)
    "documents+window+sinks+gqa": (True, 3, 4, 1, 6, True),
    "causal+sinks": (False, None, 2, 2, 6, True),
}


@pytest.mark.parametrize("fused", [True, False], ids=["cpu_kernel", "written_out"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_span_attention_equals_dense_attention_with_every_gradient(case, fused, monkeypatch):
    """written_out: the softmax of devices other than CPU (no fused kernel with log-sum-exp there)."""
    if not fused:
        monkeypatch.setattr(softmax_blocks, "_fused", lambda q, v: False)
    documents, window, heads, kv_heads, v_dim, with_sinks = CASES[case]
    torch.manual_seed(0)
    batch = 2
    q = torch.randn(batch, heads, SEQ, 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, kv_heads, SEQ, 6, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, kv_heads, SEQ, v_dim, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(heads, dtype=torch.float64, requires_grad=True) if with_sinks else None
    mask = SpanMask.of_documents(doc_ids(), window) if documents else SpanMask.causal(SEQ, window)
    dense = dense_document_mask(doc_ids()) if documents else torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).tril()
    if window:
        position = torch.arange(SEQ)
        dense = dense & (position[:, None] - position[None, :] < window)
    assert torch.equal(mask.dense(), dense)
    grad = torch.randn(batch, heads, SEQ, v_dim, dtype=torch.float64)
    inputs = [t for t in (q, k, v, sinks) if t is not None]
    out = span_attention(q, k, v, mask, sinks, rows=ROWS)
    got = torch.autograd.grad(out, inputs, grad)
    ref = dense_reference(q, k, v, dense, sinks)
    want = torch.autograd.grad(ref, inputs, grad)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for name, g, w in zip("q k v sinks".split(), got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11, msg=lambda m, n=name: f"d{n}: {m}")


def test_chunks_attend_only_the_keys_their_rows_see():
    """Every allowed (query, key) pair lies in its chunk's span, and short documents leave most of the causal
    triangle out of every span: what a chunk computes follows the mask's area."""
    length, rows = 64, 4
    ids = (torch.arange(length) // 8)[None]  # documents of 8
    mask = SpanMask.of_documents(ids)
    dense = mask.dense()[0, 0]
    area = 0
    for first, last, low in mask.spans(rows):
        assert dense[first:last, :low].sum() == 0 and dense[first:last, last:].sum() == 0
        assert torch.equal(mask.block(first, last, low)[0, 0], dense[first:last, low:last])
        area += (last - first) * (last - low)
    assert area <= 1.5 * dense.sum()  # the causal triangle's area is 4x the documents' here
    window = SpanMask.causal(length, 6)
    assert max(last - low for _, last, low in window.spans(rows)) == rows + 5


def test_a_pipeline_splits_the_mask_along_the_batch_like_the_inputs():
    mask = SpanMask.of_documents(doc_ids(), 4)
    _, chunks = split_args_kwargs_into_chunks((), {"attn_mask": mask}, 2)
    for row, kwargs in enumerate(chunks):
        part = kwargs["attn_mask"]
        assert isinstance(part, SpanMask) and part.window == 4
        assert torch.equal(part.dense(), mask.dense()[row:row + 1])


def test_fake_tensors_take_the_causal_spans():
    """estimate-memory's fake tokens have no documents to read: every chunk spans back to position 0 (the most
    any tokens can make), forward and backward run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        ids = torch.zeros(1, 12, dtype=torch.long)
        mask = SpanMask.of_documents(ids)
        q = torch.randn(1, 2, 12, 4, requires_grad=True)
        span_attention(q, q, q, mask, rows=4).sum().backward()
        assert [low for _, _, low in mask.spans(4)] == [0, 0, 0]
        assert q.grad.shape == q.shape


def test_a_compiled_block_runs_the_same_kernel_as_one_op():
    """Blocks compile whole (fullgraph): there the kernel runs as one opaque op, forward and backward equal to
    eager (backend eager: dynamo traces the block whole, without code generation)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, SEQ, 6, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    mask = SpanMask.of_documents(doc_ids(), 4)

    def attend(q, k, v, sinks, starts):
        return span_attention(q, k, v, SpanMask(starts, 4), sinks, rows=ROWS)

    compiled = torch.compile(attend, backend="eager", fullgraph=True)
    grad = torch.randn(2, 4, SEQ, 6, dtype=torch.float64)
    got = compiled(q, k, v, sinks, mask.starts)
    want = attend(q, k, v, sinks, mask.starts)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    for g, w in zip(torch.autograd.grad(got, (q, k, v, sinks), grad), torch.autograd.grad(want, (q, k, v, sinks), grad)):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_whole_and_causal_blocks_run_the_fused_kernel_without_a_mask():
    """A block every query sees whole goes without a mask, the exact causal triangle as causal (the upper half
    skipped), any other block under its mask; each gives what the masked call gives, forward and backward."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4) for _ in range(3))
    documents = dense_document_mask(torch.tensor([[0] * 3 + [1] * 5] * 2))
    blocks = {"whole": torch.ones(2, 1, 8, 8, dtype=torch.bool), "causal": torch.ones(1, 1, 8, 8, dtype=torch.bool).tril(),
              "documents": documents}
    kinds = {name: softmax_blocks._fused_mask(block, q.dtype) for name, block in blocks.items()}
    assert [(mask is None, causal) for mask, causal in kinds.values()] == [(True, False), (True, True), (False, False)]
    for name, block in blocks.items():
        additive = softmax_blocks._additive(block, q.dtype)
        out, lse = softmax_blocks.block_forward(q, k, v, block)
        want_out, want_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False,
                                                                                      attn_mask=additive)
        torch.testing.assert_close((out, lse), (want_out, want_lse), rtol=0, atol=1e-6, msg=name)
        grad = torch.randn_like(out)
        got = softmax_blocks.block_backward(grad, q, k, v, out, lse, block)
        want = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, want_out, want_lse, 0.0, False, attn_mask=additive, scale=None)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("fused", [True, False], ids=["cpu_kernel", "written_out"])
def test_a_block_in_pieces_computes_only_the_columns_its_rows_see_and_equals_it_whole(fused, monkeypatch):
    """The masked ring's blocks go in pieces of rows, each over the columns its rows see: equal to the block at
    once, forward and backward, with rows and whole pieces that see no key (out 0, log-sum-exp -inf)."""
    if not fused:
        monkeypatch.setattr(softmax_blocks, "_fused", lambda q, v: False)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, SEQ, 6, dtype=torch.float64) for _ in range(3))
    block = dense_document_mask(doc_ids())[:, :, :, 8:]  # keys 8..23: rows before 8 see none of them
    k, v = k[:, :, 8:], v[:, :, 8:]
    pieces = list(softmax_blocks._pieces(block, ROWS))
    assert pieces[0][0] == 5 and all(c1 - c0 < block.shape[-1] for _, _, c0, c1 in pieces[:2])
    out, lse = softmax_blocks.sparse_block_forward(q, k, v, block, rows=ROWS)
    want_out, want_lse = softmax_blocks.block_forward(q, k, v, block)
    torch.testing.assert_close((out, lse), (want_out, want_lse), rtol=0, atol=1e-12)
    assert lse[:, :, :8].isinf().all()
    # backward takes the row's merged statistics (the ring's other blocks, here a sink): finite in every row
    merged = torch.logaddexp(lse, torch.zeros_like(lse))
    out = out * torch.exp(lse - merged)[..., None]
    grad = torch.randn_like(out)
    got = softmax_blocks.sparse_block_backward(grad, q, k, v, out, merged, block, rows=ROWS)
    want = softmax_blocks.block_backward(grad, q, k, v, out, merged, block)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-11)

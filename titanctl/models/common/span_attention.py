"""Attention under a ``SpanMask`` (documents, a sliding window, optional attention sinks) that attends each chunk
of queries to the contiguous keys its rows can see and nothing else: no T x T mask or score is ever made or kept.

Forward: for each chunk of ``SPAN_CHUNK_ROWS`` queries ``first .. last - 1`` (``SpanMask.spans``: keys
``low .. last - 1``), its block of the mask is made from the document starts, attended with its log-sum-exp
(``softmax_blocks.block_forward``: torch's fused CPU kernel, elsewhere the softmax written out) and dropped. Each
query's keys all lie in its chunk's span, so the chunk's output and log-sum-exp are already the row's whole
softmax. An attention sink (one logit per head in the denominator only) then joins the log-sum-exp.
Compute follows the mask's area: a chunk computes rows x span pairs, so beyond the mask a row computes the rest of
its chunk (rows / 2 keys on average), and in a chunk that a document starts inside, the rows after the start also
the earlier document's keys in the span.

Backward recomputes each chunk's block from the saved output and log-sum-exp (exact: the fused backward takes
the merged statistics) and adds its keys' and values' gradient into their span. Saved: q, k, v in their dtype,
the output and the log-sum-exp (O(T)); transient: one chunk's block of the mask (rows x span).

Half-precision inputs compute in fp32 (as the model's other CPU attention does for small heads); fp32 and fp64
stay. Grouped-query attention runs inside the kernels; MLA's values, narrower than its keys, are widened with
zero columns for the fused kernel and cut back.
"""

from __future__ import annotations

import torch
from torch import Tensor

from titanctl.models.common.softmax_blocks import block_backward, block_forward, work_dtype
from titanctl.models.common.span_mask import SpanMask

# Queries per chunk: smaller, the less a chunk computes beyond the mask (rows / 2 keys a row on average) and the
# smaller its block of the mask (rows x span, all that is ever made of it); larger, the fewer kernel calls.
SPAN_CHUNK_ROWS = 256


def _attend(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, mask: SpanMask,
            rows: int) -> tuple[Tensor, Tensor]:
    """(out (B, H, T, d_v), lse (B, H, T)) in the kernels' dtype, chunk by chunk, the sink merged in."""
    work = work_dtype(q)
    qw, kw, vw = q.to(work), k.to(work), v.to(work)
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=work, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=work, device=q.device)
    for first, last, low in mask.spans(rows):
        block = mask.block(first, last, low)
        out_c, lse_c = block_forward(qw[:, :, first:last], kw[:, :, low:last], vw[:, :, low:last], block)
        out[:, :, first:last], lse[:, :, first:last] = out_c, lse_c.to(work)
    if sinks is not None:  # the sink joins each head's denominator once
        total = torch.logaddexp(lse, sinks.to(work).view(1, -1, 1))
        out, lse = out * torch.exp(lse - total)[..., None], total
    return out, lse


def _attend_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: SpanMask,
                     rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the inputs' dtypes, each chunk's block recomputed."""
    work = out.dtype
    qw, kw, vw = q.to(work), k.to(work), v.to(work)
    grad = grad_out.to(work).contiguous()
    dq = torch.empty_like(qw)
    dk, dv = torch.zeros_like(kw), torch.zeros_like(vw)
    for first, last, low in mask.spans(rows):
        rows_c, keys = slice(first, last), slice(low, last)
        dq_c, dk_c, dv_c = block_backward(
            grad[:, :, rows_c].contiguous(), qw[:, :, rows_c], kw[:, :, keys], vw[:, :, keys],
            out[:, :, rows_c].contiguous(), lse[:, :, rows_c].contiguous(), mask.block(first, last, low),
        )
        dq[:, :, rows_c] = dq_c
        dk[:, :, keys] += dk_c
        dv[:, :, keys] += dv_c
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _sinks_grad(grad_out: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d out / d sink = -p_sink out per row: the sink's gradient is -sum of p_sink (dO . out)."""
    p_sink = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)  # (B, H, T)
    return -(p_sink * (grad_out.to(out.dtype) * out).sum(-1)).sum(dim=(0, 2)).to(sinks.dtype)


class SpanAttention(torch.autograd.Function):
    """Attention of q (B, H, T, d) over k, v (B, H_kv, T, d_k / d_v) under a SpanMask (module docstring), eager."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, mask: SpanMask, rows: int) -> Tensor:
        out, lse = _attend(q, k, v, sinks, mask, rows)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.mask, ctx.rows = mask, rows
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = _attend_backward(grad_out, q, k, v, out, lse, ctx.mask, ctx.rows)
        dsinks = _sinks_grad(grad_out, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None


# Inside a compiled block (fullgraph) the same kernel runs as one opaque op: its chunk spans are read off the
# starts' values, which a graph cannot do; the op's fake forms give the shapes alone.
@torch.library.custom_op("titanctl::span_attention", mutates_args=())
def _span_attention_op(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, starts: Tensor, window: int,
                       rows: int) -> tuple[Tensor, Tensor]:
    return _attend(q, k, v, sinks, SpanMask(starts, window), rows)


@_span_attention_op.register_fake
def _(q, k, v, sinks, starts, window, rows):
    work = work_dtype(q)
    return q.new_empty(*q.shape[:-1], v.shape[-1], dtype=work), q.new_empty(q.shape[:-1], dtype=work)


@torch.library.custom_op("titanctl::span_attention_backward", mutates_args=())
def _span_attention_backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                starts: Tensor, window: int, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    return _attend_backward(grad_out, q, k, v, out, lse, SpanMask(starts, window), rows)


@_span_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, starts, window, rows):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _op_setup(ctx, inputs, output):
    q, k, v, sinks, starts, window, rows = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks, starts)
    ctx.window, ctx.rows = window, rows


def _op_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, sinks, starts = ctx.saved_tensors
    dq, dk, dv = _span_attention_backward_op(grad_out, q, k, v, out, lse, starts, ctx.window, ctx.rows)
    dsinks = _sinks_grad(grad_out, out, lse, sinks) if sinks is not None else None
    return dq, dk, dv, dsinks, None, None, None


_span_attention_op.register_autograd(_op_backward, setup_context=_op_setup)


def span_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: SpanMask, sinks: Tensor | None = None, rows: int = SPAN_CHUNK_ROWS
) -> Tensor:
    """Attention output (B, H, T, d_v) of q (B, H, T, d) over k, v (B, H_kv, T, ...) under ``mask``, with
    ``sinks`` (H,) in each head's softmax when given; ``rows`` queries a chunk."""
    if mask.length != q.shape[2] or k.shape[2] != q.shape[2]:
        raise ValueError(f"span attention: a mask over {mask.length} positions for {q.shape[2]} queries and "
                         f"{k.shape[2]} keys; it takes the whole sequence, in order")
    if torch.compiler.is_compiling():
        out, _ = _span_attention_op(q, k, v, sinks, mask.starts, mask.window or 0, rows)
        return out.to(q.dtype)
    return SpanAttention.apply(q, k, v, sinks, mask, rows)

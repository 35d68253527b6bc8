"""One block of attention at a time with its log-sum-exp, forward and backward, and the merge of two blocks'
partial softmaxes: the pieces from which the masked ring (ring context parallelism) and ``span_attention`` (one
sequence, chunk by chunk) build exact attention under a mask without ever holding all of its scores.

On CPU each block runs torch's fused kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its backward,
which return and take the log-sum-exp); elsewhere the softmax written out. The backward takes the merged output
and log-sum-exp of every block of a row (an attention sink's share included), so each block's share is exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

from titanctl import _torch_compat
from titanctl.models.common.span_mask import is_fake


def work_dtype(t: Tensor) -> torch.dtype:
    """The block kernels' dtype: half inputs run in fp32 (as the model's own CPU attention does); fp32/fp64 stay."""
    return torch.float32 if t.dtype in (torch.bfloat16, torch.float16) else t.dtype


def _additive(block: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.zeros(block.shape, dtype=dtype, device=block.device).masked_fill(~block, float("-inf"))


def _fused_mask(block: Tensor, dtype: torch.dtype) -> tuple[Tensor | None, bool]:
    """The fused kernel's (attn_mask, is_causal) for ``block``: a block every query sees whole needs no mask, and
    one that is exactly the causal triangle (a rank's own shard, or a chunk's, under one document) runs causal,
    which skips the upper half (the same bits; the times: benchmarks/cpu_kernels.py)."""
    if is_fake(block):  # estimate-memory: no values to read; the masked call
        return _additive(block, dtype), False
    if bool(block.all()):
        return None, False
    rows, cols = block.shape[-2:]
    if rows == cols and torch.equal(block, torch.ones(rows, cols, dtype=torch.bool, device=block.device).tril()
                                    .expand_as(block)):
        return None, True
    return _additive(block, dtype), False


def _written_out(q: Tensor, k: Tensor, v: Tensor, block: Tensor) -> tuple[Tensor, Tensor]:
    """One block's (out, lse) by the softmax written out (devices without torch's fused CPU kernel)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, T_q, T_k)
    scores = scores.masked_fill(~block, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.masked_fill(lse.isinf(), 0.0)[..., None])
    return weights @ v, lse


def _widened(v: Tensor, width: int) -> Tensor:
    """v with zero columns up to ``width``: torch's fused CPU kernel needs values as wide as the keys (MLA's are
    narrower); a zero column of the values is a zero column of the output and of its gradient, nothing else."""
    return v if v.shape[-1] == width else torch.nn.functional.pad(v, (0, width - v.shape[-1]))


def _fused(q: Tensor, v: Tensor) -> bool:
    return q.device.type == "cpu" and v.shape[-1] <= q.shape[-1]


def block_forward(q: Tensor, k: Tensor, v: Tensor, block: Tensor) -> tuple[Tensor, Tensor]:
    """(out (B, H, T_q, d_v), lse (B, H, T_q)) of q over one key shard under ``block``; rows that see no key of
    the shard: out 0, lse -inf."""
    if _fused(q, v):
        mask, causal = _fused_mask(block, q.dtype)
        out, lse = _torch_compat.CPU_FLASH_SDPA.get()(q, k, _widened(v, k.shape[-1]), 0.0, causal, attn_mask=mask)
        out = out[..., : v.shape[-1]]
    else:
        out, lse = _written_out(q, k, v, block)
    seen = block.any(dim=-1)  # (B or 1, 1, T_q); the fused kernel gives a row with no key lse 0, not -inf
    return out.masked_fill(~seen[..., None], 0.0), lse.masked_fill(~seen, float("-inf"))


def block_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, block: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block, given the merged output and log-sum-exp (so its share of the softmax is exact)."""
    if _fused(q, v):
        width = k.shape[-1]
        mask, causal = _fused_mask(block, q.dtype)
        dq, dk, dv = _torch_compat.CPU_FLASH_SDPA_BACKWARD.get()(
            _widened(grad, width), q, k, _widened(v, width), _widened(out, width), lse, 0.0, causal,
            attn_mask=mask, scale=None,
        )
        return dq, dk, dv[..., : v.shape[-1]]
    # the softmax's backward written out: P = exp(S - lse), dS = P (dO V^T - rowsum(dO * out))
    batch, heads, rows, _ = q.shape
    kv_heads, groups, scale = k.shape[1], heads // k.shape[1], q.shape[-1] ** -0.5
    kr, vr = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = ((q @ kr.transpose(-2, -1)) * scale).masked_fill(~block, float("-inf"))
    weights = torch.exp(scores - lse[..., None])  # (B, H, T_q, T_k)
    d_scores = weights * (grad @ vr.transpose(-2, -1) - (grad * out).sum(-1, keepdim=True))
    dk = (d_scores.transpose(-2, -1) @ q * scale).view(batch, kv_heads, groups, *k.shape[2:]).sum(2)
    dv = (weights.transpose(-2, -1) @ grad).view(batch, kv_heads, groups, *v.shape[2:]).sum(2)
    return d_scores @ kr * scale, dk, dv


def merge(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial softmaxes over disjoint keys as one (rows seen by neither stay out 0, lse -inf)."""
    new = torch.logaddexp(lse, lse_b)
    safe = new.masked_fill(new.isinf(), 0.0)
    return out * torch.exp(lse - safe)[..., None] + out_b * torch.exp(lse_b - safe)[..., None], new


# Queries per piece of a block in ``sparse_block_forward``: a piece computes only the columns its rows see.
PIECE_ROWS = 256


def _pieces(block: Tensor, rows: int):
    """(r0, r1, c0, c1) per piece of ``rows`` queries of ``block`` that sees any key: its rows r0 .. r1 - 1 see keys
    within columns c0 .. c1 - 1 only (in every batch row). Exact for any mask; a document mask's pieces see a few
    documents' keys each."""
    if is_fake(block):  # estimate-memory: no values, every column
        yield from ((r0, min(r0 + rows, block.shape[-2]), 0, block.shape[-1]) for r0 in range(0, block.shape[-2], rows))
        return
    for r0 in range(0, block.shape[-2], rows):
        r1 = min(r0 + rows, block.shape[-2])
        seen = block[..., r0:r1, :].flatten(0, -2).any(dim=0).nonzero()
        if seen.numel():
            yield r0, r1, int(seen[0]), int(seen[-1]) + 1


def sparse_block_forward(q: Tensor, k: Tensor, v: Tensor, block: Tensor, rows: int = PIECE_ROWS):
    """``block_forward`` piece by piece, each piece of queries over only the columns its rows see: a large block of
    the masked ring under documents computes about the mask's pairs, not all of them."""
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    for r0, r1, c0, c1 in _pieces(block, rows):
        out[:, :, r0:r1], lse[:, :, r0:r1] = block_forward(q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1],
                                                           block[..., r0:r1, c0:c1])
    return out, lse


def sparse_block_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, block: Tensor,
                          rows: int = PIECE_ROWS) -> tuple[Tensor, Tensor, Tensor]:
    """``block_backward`` by ``sparse_block_forward``'s pieces."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for r0, r1, c0, c1 in _pieces(block, rows):
        dq_p, dk_p, dv_p = block_backward(
            grad[:, :, r0:r1].contiguous(), q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1],
            out[:, :, r0:r1].contiguous(), lse[:, :, r0:r1].contiguous(), block[..., r0:r1, c0:c1],
        )
        dq[:, :, r0:r1] = dq_p
        dk[:, :, c0:c1] += dk_p
        dv[:, :, c0:c1] += dv_p
    return dq, dk, dv

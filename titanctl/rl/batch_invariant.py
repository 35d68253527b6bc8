"""Batch-invariant kernels: a row's result never depends on the other rows computed with it.

The sampler scores a token in a decode step (a few rows, the KV cache's keys) and the trainer scores it
again in a training forward (many rows, the sequence's keys). With the default kernels the two logprobs
differ in their last bits, because a kernel's reduction order depends on the shape it is given:

- CPU GEMMs (MKL, oneDNN) block and thread the reduction differently for different row counts
  (measured on the debug model's shapes: ``F.linear`` of one row differs from the same row inside 2 to
  1,000 rows in 16 of 17 row counts);
- attention reduces over as many keys as it is given: the cache's length in decode, the sequence's in
  training;
- an elementwise kernel computes the vectors of a tensor with one instruction sequence and its last few
  elements with another (``silu``: 79 of 2,000 values differ), so a value's result depends on where the
  tensor's end falls.

Under :class:`BatchInvariant` (a ``TorchFunctionMode``: the model runs as it is, unaware of it) every
such kernel is replaced by one whose per-row work is fixed:

- linear layers (``F.linear`` and oneDNN's linear op) multiply rows in tiles of ``ROW_TILE`` rows, one
  batched GEMM of identical (ROW_TILE, in, out) products: each row is computed by the same product of
  the same shape wherever it sits (checked for every row position and 1 to 4,096 tiles);
- attention pads the keys to ``key_length`` (the KV cache's length) with zeros and scores the query rows
  in tiles of ``ROW_TILE`` rows, as the linear layers multiply them: one product of a fixed shape for the
  scores, a softmax in fp32 over the key_length keys, masked by position, and one product of a fixed
  shape for the weighted values, so decode and training reduce over the same keys in the same order;
- ``silu`` runs on its input padded to whole vectors (every element takes the vector path), ``rsqrt``
  as ``1 / sqrt`` (both correctly rounded on every path);
- routed experts (``torch._grouped_mm``) multiply each expert's rows in tiles too.

Everything else the families run is already row-local and exact per element (embedding lookups, RoPE's
products, norms' means over a row, residual adds, softmax and log-softmax over a row). The mode is eager
only: a compiled kernel fuses and reorders what it likes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from titanctl import _torch_compat
from titanctl.parallel.converters.onednn_linear import onednn_mm_t

ROW_TILE = 16  # rows per product of a linear layer
VECTOR = 64  # elements: a multiple of every CPU vector width torch uses (AVX-512 loops take 2 x 16 floats)


def row_tiles(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, int]:
    """x (M, K) -> (ceil(M / tile), tile, K) zero-padded, and M."""
    rows = x.shape[0]
    return F.pad(x, (0, 0, 0, -rows % tile)).view(-1, tile, x.shape[1]), rows


class TiledMatmul(torch.autograd.Function):
    """The forward in row tiles; the backward as a plain matmul's: only the forward's values must not depend
    on the batch (the logprobs), and autograd through the tiles would reduce the weight's gradient over one
    copy of it per tile."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w_t)
        flat = x.reshape(-1, x.shape[-1])
        tiles, rows = row_tiles(flat, ROW_TILE)
        out = torch.bmm(tiles, w_t.expand(tiles.shape[0], *w_t.shape))  # (tiles, ROW_TILE, N)
        return out.reshape(-1, w_t.shape[1])[:rows].view(*x.shape[:-1], w_t.shape[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, w_t = ctx.saved_tensors
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_x = (flat_grad @ w_t.t()).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = x.reshape(-1, x.shape[-1]).t() @ flat_grad if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def tiled_matmul(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ w_t (K, N), each row computed the same way whatever the number of rows."""
    return TiledMatmul.apply(x, w_t)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = tiled_matmul(x, weight.t())
    return out if bias is None else out + bias


def silu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``F.silu`` with every element on the vector path: the flattened input padded to whole vectors, on
    one thread (a second one would start its share mid-vector)."""
    flat = x.reshape(-1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = F.silu(F.pad(flat, (0, -flat.numel() % VECTOR)))[: flat.numel()]
    finally:
        torch.set_num_threads(threads)
    return out.view(x.shape)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / torch.sqrt(x)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, *,
    key_length: int,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of q (B, H, T, D) over k, v (B, H_kv, S, D) with S <= key_length:
    every query row scores all ``key_length`` keys (the missing ones zeros, masked), each score a sum over D
    products and each output a sum over key_length products, reduced along a contiguous last dimension of
    that fixed length (the same order for every row, however many rows there are). ``attn_mask``: bool,
    True = attend, broadcast to (B, H, T, S); None with ``is_causal``: key j seen from query t when j <= t."""
    if dropout_p:
        raise ValueError("batch-invariant attention has no dropout")
    batch, heads, length, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    if keys > key_length:
        raise ValueError(f"attention over {keys} keys, more than the batch-invariant key length {key_length}")
    if heads != kv_heads and not enable_gqa:
        raise ValueError("query and key heads differ without enable_gqa")
    group = heads // kv_heads
    if attn_mask is None:
        attn_mask = torch.ones(length, keys, dtype=torch.bool, device=q.device)
        if is_causal:
            attn_mask = attn_mask.tril()
    # The query rows that share a key/value head (head h = j * group + r serves KV head j), in tiles of
    # ROW_TILE rows: every tile is one (ROW_TILE, D) x (D, key_length) product, then one (ROW_TILE,
    # key_length) x (key_length, D), whatever the number of rows. Padded rows see every key (no NaN).
    rows = group * length
    pad = -rows % ROW_TILE
    tiles = (rows + pad) // ROW_TILE
    q_tiles = F.pad(q.reshape(batch, kv_heads, rows, dim), (0, 0, 0, pad)).reshape(-1, ROW_TILE, dim)
    k = F.pad(k, (0, 0, 0, key_length - keys))  # (B, H_kv, L, D)
    v = F.pad(v, (0, 0, 0, key_length - keys)).float()

    def per_tile(t: torch.Tensor) -> torch.Tensor:  # (B, H_kv, X, Y) -> (B * H_kv * tiles, X, Y)
        return t[:, :, None].expand(batch, kv_heads, tiles, *t.shape[2:]).reshape(-1, *t.shape[2:])

    seen = F.pad(attn_mask.expand(batch, heads, length, keys), (0, key_length - keys), value=False)
    seen = F.pad(seen.reshape(batch, kv_heads, rows, key_length), (0, 0, 0, pad), value=True)
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    scores = torch.bmm(q_tiles, per_tile(k.transpose(-2, -1))).float() * scale  # (B * H_kv * tiles, T, L)
    scores = scores.masked_fill(~seen.reshape(-1, ROW_TILE, key_length), float("-inf"))
    out = torch.bmm(torch.softmax(scores, dim=-1), per_tile(v))  # (B * H_kv * tiles, ROW_TILE, D)
    out = out.reshape(batch, kv_heads, rows + pad, dim)[:, :, :rows]
    return out.reshape(batch, heads, length, dim).to(q.dtype)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x (M, K), w (E, K, N), offs)``: expert e's rows (offs[e - 1]:offs[e]) times w[e],
    each in tiles."""
    ends = offs.tolist()
    pieces, start = [], 0
    for e, end in enumerate(ends):
        pieces.append(tiled_matmul(x[start:end], w[e]))
        start = end
    return torch.cat(pieces) if pieces else x.new_zeros(0, w.shape[-1])


class BatchInvariant(TorchFunctionMode):
    """Run the model with batch-invariant kernels (see the module docstring); ``key_length``: the KV
    cache's length, over which every attention reduces."""

    def __init__(self, key_length: int):
        super().__init__()
        self.key_length = key_length
        self._grouped_mm = _torch_compat.GROUPED_MM.get()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear(*args, **kwargs)
        if func is onednn_mm_t or func is torch.ops.titanctl.onednn_mm_t.default:
            a, b = args
            return tiled_matmul(a, b.t())
        if func is F.scaled_dot_product_attention:
            return attention(*args, **kwargs, key_length=self.key_length)
        if func is F.silu:
            return silu(*args, **kwargs)
        if func is torch.rsqrt or func is torch.Tensor.rsqrt:
            return rsqrt(*args)
        if func is self._grouped_mm:
            return grouped_mm(*args, **kwargs)
        return func(*args, **kwargs)

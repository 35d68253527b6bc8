"""Grouped-query self-attention with RoPE, optional per-head QK norm, and a static KV cache.

Training attends causally, or under a mask passed in (``attn_mask``: a dense bool tensor or a
FlexAttention BlockMask, see ``document_mask``), which every layer applies unchanged, or a dict of
masks by layer type (``ModelArgs.layer_types``) from which each layer takes its own.

gpt-oss adds two switches. A sliding-window layer (``ModelArgs.is_sliding_layer``) sees only the
last ``sliding_window`` positions: without a dict of masks it narrows the mask it is given (or the
causal one) to that window itself, over positions 0..T-1. Attention sinks (``ModelArgs.attention_sinks``)
add one learned logit per query head to every softmax, attending to no value; no fused kernel of
torch 2.13 takes such a logit, so those layers run the softmax written out (``sink_attention``), which
holds the (B, H, T, S) scores in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint

from titanctl.models.common.args import ModelArgs
from titanctl.models.common.norms import build_norm
from titanctl.models.common.rope import rope_for, rope_function


class KVCache(nn.Module):
    """Keys and values of every position a generation may reach, allocated once:
    (B, H_kv, max_seq_len, head_dim) each, the layout attention reads.

    Written at a tensor of positions (``index_copy_``), never sliced by a Python number, so a
    decode step is the same computation at every position and compiles once.
    """

    def __init__(self, batch: int, max_seq_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        shape = (batch, kv_heads, max_seq_len, head_dim)
        # Zeros, not empty: masked-out positions still enter the weighted sum (with weight 0).
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("positions", torch.arange(max_seq_len, device=device), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, T, head_dim) at positions input_pos (T,); return the whole cache."""
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v  # (B, H_kv, S_max, head_dim)

    def mask(self, input_pos: torch.Tensor, window: int = 0) -> torch.Tensor:
        """(T, S_max): the query at position p sees the keys at positions <= p (and > p - window when
        ``window``: a sliding-window layer's cache keeps every position, and its mask the window's)."""
        seen = self.positions[None, :] <= input_pos[:, None]
        if window:
            seen = seen & (self.positions[None, :] > input_pos[:, None] - window)
        return seen


# Below this head size, torch's (2.13) bf16/fp16 flash-attention kernel on CPU is slower than its
# fp32 one (1.5-1.8x the time at head_dim 16, forward + backward; benchmarks/cpu_kernels.py).
CPU_FP32_ATTENTION_BELOW_HEAD_DIM = 64


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """Scaled dot-product attention of q (B, H, T, head_dim) over k, v (B, H_kv, S, head_dim).

    Grouped-query attention happens inside the kernel (no repeated copies of K and V). On CPU,
    bf16/fp16 attention with small heads runs in fp32 (faster there, and more precise); its output
    returns to q's dtype.
    """
    gqa = k.shape[1] != q.shape[1]
    if q.device.type == "cpu" and q.dtype != torch.float32 and q.shape[-1] < CPU_FP32_ATTENTION_BELOW_HEAD_DIM:
        with torch.autocast("cpu", enabled=False):
            out = F.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal, enable_gqa=gqa
            )
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


# Scores of one chunk of queries in sink_attention: batch x heads x queries x keys (1 GiB in fp32). Above it
# the queries go in chunks, each recomputed in backward, so that no layer holds all its (B, H, T, S) scores.
SINK_CHUNK_ELEMENTS = 2**28


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor
) -> torch.Tensor:
    """Attention of q (B, H, T, head_dim) over k, v (B, H_kv, S, head_dim) whose softmax also takes
    ``sinks`` (H,), one logit per query head that attends to no value (gpt-oss). ``mask``: a dense bool
    mask broadcast to (B, H, T, S), True = attend; None is causal (T == S). Scores and softmax in fp32;
    the output in q's dtype. Long sequences go SINK_CHUNK_ELEMENTS of scores at a time, each chunk's
    recomputed in backward (the same numbers: each query's softmax is its own)."""
    if isinstance(mask, BlockMask):
        raise ValueError("attention with sinks takes a dense bool mask, not a FlexAttention BlockMask")
    batch, heads, length, _ = q.shape
    groups = heads // k.shape[1]
    if groups > 1:  # key/value head j serves query heads j * groups .. (j + 1) * groups - 1
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, S, head_dim)
    k, v = k.float(), v.float()
    rows = max(1, SINK_CHUNK_ELEMENTS // (batch * heads * k.shape[2]))
    if rows >= length:
        return _sink_rows(q, k, v, mask, sinks, 0)
    chunks = []
    for start in range(0, length, rows):
        part = None if mask is None else mask[..., start : start + rows, :]
        args = (q[:, :, start : start + rows], k, v, part, sinks, start)
        chunks.append(checkpoint(_sink_rows, *args, use_reentrant=False) if torch.is_grad_enabled()
                      else _sink_rows(*args))
    return torch.cat(chunks, dim=2)


def _sink_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor,
               first: int) -> torch.Tensor:
    """``sink_attention`` of the queries at positions first.. (q (B, H, rows, head_dim)) over fp32 k, v
    (B, H, S, head_dim); ``mask`` their rows, None: causal."""
    batch, heads, rows, _ = q.shape
    scores = torch.matmul(q.float(), k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, rows, S)
    if mask is None:
        queries = torch.arange(first, first + rows, device=q.device)
        mask = torch.arange(k.shape[2], device=q.device)[None, :] <= queries[:, None]  # (rows, S)
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, heads, 1, 1).expand(batch, heads, rows, 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # the sink's share dropped
    return torch.matmul(weights, v).to(q.dtype)  # (B, H, rows, head_dim)


def cached_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of q (B, H, T, head_dim) over a KV cache k, v (B, H_kv, S, head_dim) under ``mask`` (T, S)
    (with ``sinks``: ``sink_attention``).

    One new position per head (decoding): the heads that share a key/value head attend as that head's
    rows, (B, H_kv, H/H_kv, head_dim) over k, v, the same products without grouped-query attention. torch's
    math kernel (the compiled decode step's, where it is the faster) repeats K and V for every head first:
    the whole cache copied per layer and token.
    """
    if sinks is not None:
        return sink_attention(q, k, v, mask, sinks)
    batch, heads, length, head_dim = q.shape
    groups = k.shape[1]
    if length != 1 or groups == heads:
        return attention(q, k, v, mask, causal=False)
    out = attention(q.reshape(batch, groups, heads // groups, head_dim), k, v, mask, causal=False)
    return out.reshape(batch, heads, 1, head_dim)


_compiled_flex_attention = None


def masked_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """FlexAttention of q (B, H, T_q, head_dim) over k, v (B, H_kv, T_kv, head_dim) under ``block_mask``.

    Compiled once per process: uncompiled, FlexAttention materializes every score.
    """
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    gqa = k.shape[1] != q.shape[1]
    return _compiled_flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)


class AttentionKernel(nn.Module):
    """The attention of training: causal without a mask, else under ``mask``; with ``sinks`` (a
    keyword, so that hooks on the positional q, k, v, mask leave it alone) ``sink_attention``.

    No parameters: it is a module so that a parallel layout can hook it (context parallelism
    with a document mask gathers every rank's keys and values before it), never so that the
    model knows about such layouts.
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None = None,
        *, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if sinks is not None:
            return sink_attention(q, k, v, mask, sinks)
        if isinstance(mask, BlockMask):
            return masked_flex_attention(q, k, v, mask)
        return attention(q, k, v, mask, causal=mask is None)


def window_mask(length: int, window: int, mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``mask`` (a dense bool mask over positions 0..length-1 for queries and keys; None: causal) narrowed to
    the last ``window`` keys of each query (itself included): (length, length), or mask's shape."""
    positions = torch.arange(length, device=device)
    distance = positions[:, None] - positions[None, :]  # (T, T) query minus key
    seen = (distance >= 0) & (distance < window)
    return seen if mask is None else mask & seen


def layer_mask(
    attn_mask: torch.Tensor | BlockMask | dict | None, layer_type: str, window: int, length: int, device: torch.device
) -> torch.Tensor | BlockMask | None:
    """The mask of one layer: its own from a dict by layer type (built by whoever knows the positions,
    e.g. context parallelism's shares), else the one mask every layer takes, narrowed to the window of a
    sliding-window layer over positions 0..length-1."""
    if isinstance(attn_mask, dict):
        return attn_mask[layer_type]
    if not window:
        return attn_mask
    if isinstance(attn_mask, BlockMask):
        raise ValueError("a sliding-window layer narrows dense masks only; pass masks by layer type")
    return window_mask(length, window, attn_mask, device)


def _local(param: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter as this rank's tensor (a head-sharded DTensor under tensor parallelism: its heads)."""
    return param.to_local() if hasattr(param, "to_local") else param


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int = 0):
        super().__init__()
        self.head_dim = args.head_dim
        bias = args.attention_bias
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=bias)
        # One logit per query head (split with the heads under tensor parallelism).
        self.sinks = nn.Parameter(torch.empty(args.n_heads)) if args.attention_sinks else None
        sliding = args.is_sliding_layer(layer_id)
        self.layer_type = "sliding_attention" if sliding else "full_attention"
        self.window = args.sliding_window if sliding else 0
        # Qwen3's QK norm: one weight of head_dim shared by all heads, so under tensor parallelism
        # it stays whole (replicated) while the heads are split.
        self.q_norm = build_norm(args, args.head_dim) if args.qk_norm else None
        self.k_norm = build_norm(args, args.head_dim) if args.qk_norm else None
        self.rotate = rope_function(args)
        self.kernel = AttentionKernel()
        self.cache: KVCache | None = None  # set by Transformer.setup_kv_cache for decoding

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        input_pos: torch.Tensor | None = None,
        attn_mask: torch.Tensor | BlockMask | None = None,
    ) -> torch.Tensor:
        """With ``input_pos`` (decoding, after ``setup_kv_cache``) x holds those positions and rope their rows.
        ``attn_mask`` (training only): which keys each query sees (True: attend); None is causal."""
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of them.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)  # (B, T, H, head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)  # (B, T, H_kv, head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)  # (B, T, H_kv, head_dim)
        if self.q_norm is not None:  # normalizes each head over head_dim: shapes unchanged
            q, k = self.q_norm(q), self.k_norm(k)
        rope = rope_for(rope, seqlen)  # the table may be longer than this sequence
        q, k = self.rotate(q, rope), self.rotate(k, rope)
        sinks = _local(self.sinks)
        if input_pos is not None:  # decoding: the new positions attend to every cached one, masked by position
            keys, values = self.cache.update(input_pos, k.transpose(1, 2), v.transpose(1, 2))  # (B, H_kv, S_max, hd)
            out = cached_attention(q.transpose(1, 2), keys, values, self.cache.mask(input_pos, self.window), sinks)
        else:
            mask = layer_mask(attn_mask, self.layer_type, self.window, seqlen, x.device)
            out = self.kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, sinks=sinks)
        # out: (B, H, T, head_dim)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))  # (B, T, dim)

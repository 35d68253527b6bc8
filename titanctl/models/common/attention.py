"""Grouped-query self-attention with RoPE, optional per-head QK norm, and a static KV cache.

Training attends causally, or under a mask passed in (``attn_mask``: a ``SpanMask``, the documents'
starts from which ``span_attention`` makes each chunk's block; a dense bool tensor; or a FlexAttention
BlockMask, see ``document_mask``), which every layer applies unchanged, or a dict of masks by layer
type (``ModelArgs.layer_types``) from which each layer takes its own.

A sliding-window layer (``ModelArgs.is_sliding_layer``) sees only the last ``sliding_window``
positions: without a dict of masks it narrows the mask it is given (or the causal one: a ``SpanMask``
of one document) to that window itself, over positions 0..T-1. A family whose attention adds to the softmax subclasses
``Attention`` and its ``AttentionKernel`` (``kernel_inputs``, ``attend_cached``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from titanctl.models.common.args import ModelArgs
from titanctl.models.common.init import INPUT, ParamInit, output_projection
from titanctl.models.common.norms import build_norm
from titanctl.models.common.rope import rope_for, rope_function
from titanctl.models.common.span_attention import span_attention
from titanctl.models.common.span_mask import SpanMask


class StaticCache(nn.Module):
    """Tensors of every position a generation may reach, allocated once (zeros: masked-out positions
    still enter the weighted sum, with weight 0), named in ``position_dims`` with the dim that indexes
    positions, in the order ``update`` takes them.

    Written at a tensor of positions (``index_copy_``), never sliced by a Python number, so a
    decode step is the same computation at every position and compiles once.
    """

    position_dims: dict[str, int]

    def update(self, input_pos: torch.Tensor, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store each of ``values`` at positions input_pos (T,); return the whole cache."""
        for (name, dim), value in zip(self.position_dims.items(), values, strict=True):
            getattr(self, name).index_copy_(dim, input_pos, value)
        return tuple(getattr(self, name) for name in self.position_dims)

    def mask(self, input_pos: torch.Tensor, window: int = 0) -> torch.Tensor:
        """(T, S_max): the query at position p sees the keys at positions <= p (and > p - window when
        ``window``: a sliding-window layer's cache keeps every position, and its mask the window's)."""
        seen = self.positions[None, :] <= input_pos[:, None]
        if window:
            seen = seen & (self.positions[None, :] > input_pos[:, None] - window)
        return seen


class KVCache(StaticCache):
    """Keys and values: (B, H_kv, max_seq_len, head_dim) each, the layout attention reads."""

    position_dims = {"k": 2, "v": 2}

    def __init__(self, batch: int, max_seq_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        shape = (batch, kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("positions", torch.arange(max_seq_len, device=device), persistent=False)


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
    half = q.dtype in (torch.bfloat16, torch.float16)  # fp64 stays fp64
    if q.device.type == "cpu" and half and q.shape[-1] < CPU_FP32_ATTENTION_BELOW_HEAD_DIM:
        with torch.autocast("cpu", enabled=False):
            out = F.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal, enable_gqa=gqa
            )
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of q (B, H, T, head_dim) over a KV cache k, v (B, H_kv, S, head_dim) under ``mask`` (T, S).

    One new position per head (decoding): the heads that share a key/value head attend as that head's
    rows, (B, H_kv, H/H_kv, head_dim) over k, v, the same products without grouped-query attention. torch's
    math kernel (the compiled decode step's, where it is the faster) repeats K and V for every head first:
    the whole cache copied per layer and token.
    """
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
    """The attention of training: causal without a mask, else under ``mask``. A subclass may take more
    inputs as keywords (``Attention.kernel_inputs``), which hooks on the positional q, k, v, mask leave
    alone.

    No parameters: it is a module so that a parallel layout can hook it (context parallelism
    with a mask runs it as a ring over every rank's keys and values), never so that the
    model knows about such layouts.
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        mask: SpanMask | torch.Tensor | BlockMask | None = None,
    ) -> torch.Tensor:
        if isinstance(mask, SpanMask):
            return span_attention(q, k, v, mask)
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
    attn_mask: SpanMask | torch.Tensor | BlockMask | dict | None, layer_type: str, window: int, length: int,
    device: torch.device,
) -> SpanMask | torch.Tensor | BlockMask | None:
    """The mask of one layer: its own from a dict by layer type (built by whoever knows the positions,
    e.g. context parallelism's shares), else the one mask every layer takes, narrowed to the window of a
    sliding-window layer over positions 0..length-1 (a ``SpanMask`` stays one; causal becomes one)."""
    if isinstance(attn_mask, dict):
        return attn_mask[layer_type]
    if not window:
        return attn_mask
    if isinstance(attn_mask, SpanMask):
        return attn_mask.narrowed(window)
    if attn_mask is None:
        return SpanMask.causal(length, window, device)
    if isinstance(attn_mask, BlockMask):
        raise ValueError("a sliding-window layer narrows dense masks only; pass masks by layer type")
    return window_mask(length, window, attn_mask, device)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int = 0):
        super().__init__()
        self.head_dim = args.head_dim
        bias = args.attention_bias
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=bias)
        sliding = args.is_sliding_layer(layer_id)
        self.layer_type = "sliding_attention" if sliding else "full_attention"
        self.window = args.sliding_window if sliding else 0
        # QK norm: one weight of head_dim shared by all heads, so under tensor parallelism it stays
        # whole (replicated) while the heads are split.
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
        attn_mask: SpanMask | torch.Tensor | BlockMask | dict | None = None,
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
        if input_pos is not None:  # decoding: the new positions attend to every cached one, masked by position
            keys, values = self.cache.update(input_pos, k.transpose(1, 2), v.transpose(1, 2))  # (B, H_kv, S_max, hd)
            out = self.attend_cached(q.transpose(1, 2), keys, values, self.cache.mask(input_pos, self.window))
        else:
            mask = layer_mask(attn_mask, self.layer_type, self.window, seqlen, x.device)
            out = self.kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, **self.kernel_inputs())
        # out: (B, H, T, head_dim)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))  # (B, T, dim)

    def new_cache(self, batch_size: int, max_seq_len: int) -> KVCache:
        """A zeroed cache of the heads ``wk`` produces (a sharded ``wk``: this rank's heads only)."""
        weight = self.wk.weight
        return KVCache(batch_size, max_seq_len, weight.shape[0] // self.head_dim, self.head_dim, weight.dtype,
                       weight.device)

    def kernel_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword inputs of ``self.kernel`` beyond q, k, v and the mask (none here)."""
        return {}

    def attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Decoding's attention of q (B, H, T, head_dim) over the cache's k, v under ``mask`` (T, S)."""
        return cached_attention(q, k, v, mask)

    def param_inits(self, depth: int) -> dict[str, ParamInit]:
        rules = {f"{name}.weight": INPUT for name in ("wq", "wk", "wv")} | {"wo.weight": output_projection(depth)}
        if self.wq.bias is not None:  # small but not zero, so that every layout's handling shows in the losses
            rules |= {f"{name}.bias": INPUT for name in ("wq", "wk", "wv", "wo")}
        return rules

"""Grouped-query self-attention with RoPE, optional per-head QK norm, and a static KV cache.

Training attends causally, or under a mask passed in (``attn_mask``: a dense bool tensor or a
FlexAttention BlockMask, see ``document_mask``), which every layer applies unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from titanctl.models.common.args import ModelArgs
from titanctl.models.common.norms import build_norm
from titanctl.models.common.rope import rope_function


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

    def mask(self, input_pos: torch.Tensor) -> torch.Tensor:
        """(T, S_max): the query at position p sees the keys at positions <= p."""
        return self.positions[None, :] <= input_pos[:, None]


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
    """The attention of training: causal without a mask, else under ``mask``.

    No parameters: it is a module so that a parallel layout can hook it (context parallelism
    with a document mask gathers every rank's keys and values before it), never so that the
    model knows about such layouts.
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None = None
    ) -> torch.Tensor:
        if isinstance(mask, BlockMask):
            return masked_flex_attention(q, k, v, mask)
        return attention(q, k, v, mask, causal=mask is None)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
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
        rope = rope[:seqlen]  # the table may be longer than this sequence
        q, k = self.rotate(q, rope), self.rotate(k, rope)
        if input_pos is not None:  # decoding: the new positions attend to every cached one, masked by position
            keys, values = self.cache.update(input_pos, k.transpose(1, 2), v.transpose(1, 2))  # (B, H_kv, S_max, hd)
            out = cached_attention(q.transpose(1, 2), keys, values, self.cache.mask(input_pos))
        else:
            out = self.kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask)
        # out: (B, H, T, head_dim)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))  # (B, T, dim)

"""Llama 3.1, written once and sharded from outside.

Nothing here knows about parallelism. Projections reshape with ``-1`` heads, so a
tensor-parallel plan that shards them column-wise just works; ``layers`` is a
ModuleDict keyed by layer id, so pipeline stages keep canonical names; and any of
``tok_embeddings``, ``norm``, ``output`` may be set to None by a pipeline split.

Inference adds an optional static KV cache (``setup_kv_cache``, then ``forward(tokens, input_pos)``
with a tensor of positions); training never passes ``input_pos`` and runs exactly the cache-free code.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titanctl.models.llama.args import ModelArgs, RopeScaling


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Rotation frequency of each pair of channels, with Llama 3.1's scaling."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return freqs.float()
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled).float()


def rope_table(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """cos and sin of every (position, pair): shape (max_seq_len, head_dim // 2, 2)."""
    freqs = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling).to(device)
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs (Meta's layout), real-valued so compile needs no complex ops.

    x: (B, T, H, head_dim); rope: (T, head_dim // 2, 2).
    """
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, T, H, head_dim // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = rope[None, :, None, :, 0], rope[None, :, None, :, 1]  # (1, T, 1, head_dim // 2)
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, normalized in fp32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class FusedRMSNorm(RMSNorm):
    """The same norm through ``F.rms_norm``. On CUDA that is one kernel forward and one backward
    instead of ~6 elementwise ops, each reading and writing the whole activation; elsewhere torch
    (2.13) has no such kernel and runs those same ops. It accumulates in fp32 too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # The fused kernel needs one dtype (autocast keeps fp32 weights beside bf16 activations).
        return F.rms_norm(x, self.weight.shape, None, self.eps) * self.weight


NORMS = {"rmsnorm": RMSNorm, "fused_rmsnorm": FusedRMSNorm}


def build_norm(args: ModelArgs) -> RMSNorm:
    if args.norm_type not in NORMS:
        raise ValueError(f"ModelArgs.norm_type {args.norm_type!r} is not one of {', '.join(NORMS)}")
    return NORMS[args.norm_type](args.dim, args.norm_eps)


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


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.cache: KVCache | None = None  # set by Transformer.setup_kv_cache for decoding

    def forward(self, x: torch.Tensor, rope: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """With ``input_pos`` (decoding, after ``setup_kv_cache``) x holds those positions and rope their rows."""
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of them.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)  # (B, T, H, head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)  # (B, T, H_kv, head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)  # (B, T, H_kv, head_dim)
        rope = rope[:seqlen]  # the table may be longer than this sequence
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if input_pos is not None:  # decoding: the new positions attend to every cached one, masked by position
            keys, values = self.cache.update(input_pos, k.transpose(1, 2), v.transpose(1, 2))  # (B, H_kv, S_max, hd)
            out = attention(q.transpose(1, 2), keys, values, self.cache.mask(input_pos), causal=False)
        else:
            out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, causal=True)
        # out: (B, H, T, head_dim)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))  # (B, T, dim)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = build_norm(args)
        self.ffn_norm = build_norm(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, input_pos=input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


@dataclass(frozen=True)
class ParamInit:
    """How one parameter is initialized: ones, or a (truncated) normal draw."""

    kind: str  # "ones" | "normal" | "trunc_normal"
    std: float = 1.0
    bound: float = 2.0  # absolute truncation bound of "trunc_normal"


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError("ModelArgs.vocab_size must be set (from the tokenizer)")
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = build_norm(args)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Derived from args, so never saved: checkpoints hold weights only.
        self.register_buffer("rope_cache", rope_table(args), persistent=False)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) ids, or (B, T, dim) hidden states inside a later pipeline stage.

        ``input_pos`` (T,) int64, after ``setup_kv_cache``: the positions of the tokens, which
        attend to the cached positions before them. Returns logits (B, T, vocab), or hidden
        states when this stage has no output layer.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # The whole table: under sequence parallel h holds only this rank's part of the sequence.
        rope = self.rope_cache
        if input_pos is not None:
            rope = rope[input_pos]  # (T, head_dim // 2, 2)
        for layer in self.layers.values():
            h = layer(h, rope, input_pos=input_pos)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def setup_kv_cache(self, max_seq_len: int | None = None, batch_size: int = 1) -> None:
        """Give every attention a zeroed KV cache of ``max_seq_len`` positions (default: the RoPE table's).

        Its heads are those the attention's ``wk`` produces, so a sharded ``wk`` gets a cache of
        its own heads only.
        """
        length = max_seq_len or self.rope_cache.shape[0]
        if length > self.rope_cache.shape[0]:
            raise ValueError(f"a {length}-position cache needs ModelArgs.max_seq_len >= {length}")
        for layer in self.layers.values():
            attention = layer.attention
            weight = attention.wk.weight
            attention.cache = KVCache(batch_size, length, weight.shape[0] // attention.head_dim, attention.head_dim,
                                      weight.dtype, weight.device)

    def clear_kv_cache(self) -> None:
        for layer in self.layers.values():
            layer.attention.cache = None

    def param_init(self, name: str) -> ParamInit:
        """The init of a parameter, from its name (wrapper prefixes are ignored)."""
        args = self.args
        if name.endswith("norm.weight"):
            return ParamInit("ones")
        if name.endswith("tok_embeddings.weight"):
            return ParamInit("normal", std=1.0)
        if name.endswith("output.weight"):
            std = args.dim**-0.5
            return ParamInit("trunc_normal", std=std, bound=3 * std)
        layer = re.search(r"layers\.(\d+)\.", name)
        if layer is None:
            raise ValueError(f"no init rule for parameter {name!r}")
        depth = int(layer.group(1)) + 1 if args.depth_init else args.n_layers
        if re.search(r"(attention\.w[qkv]|feed_forward\.w1)\.weight$", name):
            return ParamInit("trunc_normal", std=0.02)
        return ParamInit("trunc_normal", std=0.02 / math.sqrt(2 * depth))  # wo, w2, w3

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute the RoPE table (after ``to_empty`` left it uninitialized)."""
        device = device if device is not None else self.rope_cache.device
        self.rope_cache = rope_table(self.args, torch.device(device))

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialize in place from the global RNG (standalone use; training uses
        ``titanctl.parallel.init.initialize_weights`` so every layout draws the same numbers)."""
        self.init_buffers()
        for name, param in self.named_parameters():
            spec = self.param_init(name)
            if spec.kind == "ones":
                nn.init.ones_(param)
            elif spec.kind == "normal":
                nn.init.normal_(param, std=spec.std)
            else:
                nn.init.trunc_normal_(param, std=spec.std, a=-spec.bound, b=spec.bound)

"""Multi-head Latent Attention (DeepSeek-V2/V3), with a static cache of its compressed latents.

Keys and values come from one low-rank latent per position: ``wkv_a`` projects the input to the
latent (kv_lora_rank channels) and one rotary key slice shared by every head; the latent is
normalized and ``wkv_b`` expands it into each head's key (without RoPE) and value. Queries come
from ``wq``, or through a low-rank bottleneck (``wq_a`` -> norm -> ``wq_b``) when q_lora_rank > 0.
Each query/key head is [nope channels, rope channels]; RoPE turns the rope channels only.

The value head (v_head_dim) may be narrower than the query/key head. Flash attention (torch 2.13's
CPU kernel, and FlashAttention on CUDA) needs one width for q, k and v, and without it SDPA falls back
to the math kernel, which materializes every score and which context parallel's ring attention cannot
run: so values are padded with zeros to the query/key width and the output's padding is cut off (the
zero columns add nothing to the other columns). The kernels scale scores by 1/sqrt(qk_head_dim);
YaRN's softmax correction is applied to the queries beforehand.

The forward has the signature of the shared ``Attention`` (the shared decoder block calls either)
and reshapes with ``-1`` heads; nothing here knows about parallelism. Under tensor parallel
(``titanctl.models.deepseek_v3.tp_plan``) ``wq``/``wq_b`` and ``wkv_b`` split by heads, ``wo`` by its
input heads, and the latent projections (``wq_a``, ``wkv_a``) and their norms run whole on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from titanctl.models.common.args import ModelArgs
from titanctl.models.common.attention import AttentionKernel, StaticCache, attention
from titanctl.models.common.init import INPUT, ParamInit, output_projection
from titanctl.models.common.norms import build_norm
from titanctl.models.common.rope import rope_for, rope_function, yarn_softmax_factor

# DeepSeek's (and transformers') latent norms keep RMSNorm's default eps, whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


class LatentCache(StaticCache):
    """What MLA attends over: the normalized latent (B, S_max, kv_lora_rank) and the rotated shared key
    slice (B, S_max, rope_dim).

    Far smaller than per-head keys and values (the point of MLA); each decode step expands the whole
    cache through ``wkv_b``.
    """

    position_dims = {"kv": 1, "k_pe": 1}

    def __init__(self, batch: int, max_seq_len: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.register_buffer("kv", torch.zeros(batch, max_seq_len, kv_lora_rank, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("k_pe", torch.zeros(batch, max_seq_len, rope_dim, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("positions", torch.arange(max_seq_len, device=device), persistent=False)


class SharedRopeKey(nn.Module):
    """The rotary key slice one position shares with every head, broadcast to the heads:
    (B, S, rope_dim) -> (B, S, H, rope_dim).

    No parameters: a module so that a parallel layout can hook the one place where a tensor computed
    once feeds every head (under tensor parallel each rank holds some heads, so the slice's gradient
    is the sum of every rank's part), never so that the model knows about such layouts.
    """

    def forward(self, k_pe: torch.Tensor, heads: int) -> torch.Tensor:
        return k_pe.unsqueeze(2).expand(-1, -1, heads, -1)


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        mla = args.mla
        self.nope_dim, self.rope_dim, self.v_head_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.qk_head_dim = mla.qk_head_dim
        self.kv_lora_rank = mla.kv_lora_rank
        latent_norm_args = args.replace(norm_eps=LATENT_NORM_EPS)
        if mla.q_lora_rank:
            self.wq = None
            self.wq_a = nn.Linear(args.dim, mla.q_lora_rank, bias=False)
            self.q_norm = build_norm(latent_norm_args, mla.q_lora_rank)
            self.wq_b = nn.Linear(mla.q_lora_rank, args.n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(args.dim, args.n_heads * self.qk_head_dim, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = build_norm(latent_norm_args, self.kv_lora_rank)
        self.wkv_b = nn.Linear(self.kv_lora_rank, args.n_heads * (self.nope_dim + self.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_head_dim, args.dim, bias=False)
        # On the queries, so that the kernels' own 1/sqrt(qk_head_dim) completes the softmax scale.
        self.softmax_factor = yarn_softmax_factor(args.yarn)
        self.rotate = rope_function(args)
        self.shared_rope_key = SharedRopeKey()
        self.kernel = AttentionKernel()
        self.cache: LatentCache | None = None  # set by Transformer.setup_kv_cache for decoding

    def new_cache(self, batch_size: int, max_seq_len: int) -> LatentCache:
        """A zeroed cache of latents, not of per-head keys and values (whole on every rank)."""
        weight = self.wkv_a.weight
        return LatentCache(batch_size, max_seq_len, self.kv_lora_rank, self.rope_dim, weight.dtype, weight.device)

    def param_inits(self, depth: int) -> dict[str, ParamInit]:
        """The projections into and out of the latents (and queries) at 0.02, as the shared attention's q/k/v."""
        inputs = ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b")
        return {f"{name}.weight": INPUT for name in inputs} | {"wo.weight": output_projection(depth)}

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        input_pos: torch.Tensor | None = None,
        attn_mask: torch.Tensor | BlockMask | None = None,
    ) -> torch.Tensor:
        """As the shared ``Attention.forward``: with ``input_pos`` (decoding, after ``setup_kv_cache``) x holds those
        positions and rope their rows; ``attn_mask`` (training only) says which keys each query sees."""
        bsz, seqlen, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bsz, seqlen, -1, self.qk_head_dim)  # (B, T, H, qk_head_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)  # (B, T, r), (B, T, rope_dim)
        kv = self.kv_norm(kv)
        rope = rope_for(rope, seqlen)  # the table may be longer than this sequence
        q_pe = self.rotate(q_pe, rope)  # (B, T, H, rope_dim)
        k_pe = self.rotate(k_pe.unsqueeze(2), rope).squeeze(2)  # one head, shared: (B, T, rope_dim)
        mask = attn_mask
        if input_pos is not None:  # decoding: the new positions attend to every cached one, masked by position
            kv, k_pe = self.cache.update(input_pos, kv, k_pe)  # (B, S_max, r), (B, S_max, rope_dim)
            mask = self.cache.mask(input_pos)
        kv_len = kv.shape[1]
        kv = self.wkv_b(kv).view(bsz, kv_len, -1, self.nope_dim + self.v_head_dim)  # (B, S, H, nope + v)
        k_nope, v = kv.split([self.nope_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, self.shared_rope_key(k_pe, k_nope.shape[2])], dim=-1)  # (B, S, H, qk_head_dim)
        q = torch.cat([q_nope, q_pe], dim=-1)  # (B, T, H, qk_head_dim)
        if self.softmax_factor != 1.0:
            q = q * self.softmax_factor
        if self.v_head_dim < self.qk_head_dim:  # one width for flash attention (see the module docstring)
            v = F.pad(v, (0, self.qk_head_dim - self.v_head_dim))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T or S, qk_head_dim)
        if input_pos is not None:
            out = attention(q, k, v, mask, causal=False)
        else:
            out = self.kernel(q, k, v, mask)
        out = out[..., : self.v_head_dim]  # (B, H, T, v_head_dim)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))  # (B, T, dim)

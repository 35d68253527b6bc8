"""Gated DeltaNet: the linear-attention layer of hybrid models, in place of a block's softmax attention.

x -> wqkv -> a causal depthwise conv (``conv``, SiLU) -> q, k (L2-normalized; q also by key_head_dim^-1/2)
and v; beta = sigmoid(wb x), the decay g = -exp(a_log) softplus(wa x + dt_bias); the gated delta rule
(``gated_delta_rule``) per value head; an RMSNorm over each head gated by SiLU(wz x); ``out_proj``.
Each query/key head serves ``num_value_heads // num_key_heads`` consecutive value heads.

Channel order: ``wqkv``'s rows and ``conv``'s channels are stored per key-head group, for each key head h
[q_h (dk) | k_h (dk) | the value heads of h (dv each)], not [all q | all k | all v] as Hugging Face's
``in_proj_qkv`` has them (the family's hf.py reorders on the way): so a contiguous split of the rows
(tensor parallelism) gives each rank whole groups, and the layer reads its heads off the local rows.
Parameters split with the heads (``conv.weight``, ``dt_bias``, ``a_log``) are read through ``local``
(a head-sharded DTensor under tensor parallelism: this rank's heads).

Documents: under a block-causal mask (``attn_mask``, a SpanMask, dense or a BlockMask, the one every layer gets)
the conv window and the state restart at every document's first token, read off the mask itself
(a token starts a document when it may not see the token before it).

Decoding (``forward(..., input_pos)`` after ``Transformer.setup_kv_cache``): the cache holds the conv's
last ``conv_kernel - 1`` inputs and the state, not keys and values; both restart when input_pos begins at 0.
Context parallel: each call then holds pieces of the sequence, and ``sequence_scan`` (set from outside,
titanctl/parallel/layouts/linear_attention_cp.py) runs the conv and the rule with what the other pieces pass;
or ``head_exchange`` (linear_attention_ulysses.py) trades them for every position of a share of the heads
before the conv and back after the rule.
Parameter names differ from softmax attention's (``out_proj``, not ``wo``), so one Hugging Face name
map covers both kinds of layer. A variant whose input projections are fused otherwise (q, k, v and z
in one matrix per key-head group) overrides ``init_projections`` and ``project``; the rest is shared.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from titanctl.models.common.args import LinearAttentionArgs, ModelArgs
from titanctl.models.common.gated_delta_rule import (
    chunk_gated_delta_rule,
    compute_dtype,
    recurrent_gated_delta_rule,
)
from titanctl.models.common.init import INPUT, ONES, ParamInit, output_projection
from titanctl.models.common.norms import RMSNorm
from titanctl.models.common.span_mask import SpanMask


def document_starts(attn_mask: torch.Tensor | BlockMask | None, batch: int, length: int,
                    device: torch.device) -> torch.Tensor | None:
    """(B, T) bool: the tokens that may not see the token before them (a document's first), from the
    mask every layer gets; None under the causal default (one document)."""
    if attn_mask is None:
        return None
    if isinstance(attn_mask, SpanMask):  # the documents' starts themselves
        return attn_mask.document_firsts().expand(batch, length)
    t = torch.arange(1, length, device=device)
    if isinstance(attn_mask, BlockMask):
        b = torch.arange(batch, device=device)[:, None]
        sees_previous = attn_mask.mask_mod(b, torch.zeros_like(b), t[None, :], t[None, :] - 1)
        sees_previous = sees_previous.expand(batch, length - 1)
    elif isinstance(attn_mask, torch.Tensor) and attn_mask.dim() == 4 and attn_mask.shape[-2] == attn_mask.shape[-1]:
        sees_previous = attn_mask[:, 0, t, t - 1].expand(batch, length - 1)
    else:
        raise ValueError("Gated DeltaNet reads document boundaries from a SpanMask, one (B, 1, T, T) mask or a "
                         f"BlockMask; got {type(attn_mask).__name__}")
    first = torch.ones(batch, 1, dtype=torch.bool, device=device)
    return torch.cat([first, ~sees_previous.bool()], dim=1)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, starts: torch.Tensor | None,
                window: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv of x (B, T, C) with weight (C, 1, K), SiLU after. ``starts`` (B, T): no tap
    reaches back across a document's first token. ``window`` (B, K - 1, C): the inputs before x (decoding)."""
    taps = weight.shape[-1]
    length = x.shape[1]
    history = window if window is not None else x.new_zeros(x.shape[0], taps - 1, x.shape[2])
    padded = torch.cat([history.to(x.dtype), x], dim=1)  # (B, K - 1 + T, C)
    if starts is None:
        out = F.conv1d(padded.transpose(1, 2), weight, groups=weight.shape[0]).transpose(1, 2)
        return F.silu(out)
    doc = starts.long().cumsum(1)  # (B, T) document index
    out = x * weight[:, 0, -1]
    for lag in range(1, taps):  # tap K-1-lag reads the token lag back, if it is of the same document
        same = torch.zeros_like(starts)
        same[:, lag:] = doc[:, lag:] == doc[:, :-lag]
        out = out + padded[:, taps - 1 - lag : taps - 1 - lag + length] * weight[:, 0, -1 - lag] * same[..., None]
    return F.silu(out)


class GatedDeltaNetCache(nn.Module):
    """Decoding state of one Gated DeltaNet layer: the conv's last inputs and the delta-rule state."""

    def __init__(self, batch: int, taps: int, channels: int, heads: int, dk: int, dv: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.register_buffer("window", torch.zeros(batch, taps - 1, channels, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("state", torch.zeros(batch, heads, dk, dv, dtype=compute_dtype(dtype), device=device),
                             persistent=False)


class GatedDeltaNet(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int = 0):
        super().__init__()
        la: LinearAttentionArgs = args.linear_attention
        self.la = la
        self.layer_type = "linear_attention"
        self.init_projections(args.dim, la)
        self.conv = nn.Conv1d(la.conv_dim, la.conv_dim, la.conv_kernel, groups=la.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(la.num_value_heads))
        self.a_log = nn.Parameter(torch.zeros(la.num_value_heads))
        # Over each value head, its weight scaling plainly (not 1 + weight) in every family that has one;
        # gated by SiLU(wz x) after. A module of one input, so tensor parallelism can keep its weight whole.
        self.norm = RMSNorm(la.value_head_dim, args.norm_eps)
        self.out_proj = nn.Linear(la.value_dim, args.dim, bias=False)
        self.cache: GatedDeltaNetCache | None = None
        # Set from outside when each call holds pieces of a longer sequence (context parallel): an object
        # with conv(mixed, weight, attn_mask) and rule(q, k, v, g, beta, attn_mask), as this layer uses them.
        self.sequence_scan = None
        # Set from outside when each call holds a piece of the sequence but the layer may run every position for
        # a share of its heads (Ulysses): an object with to_heads(*per_head), share(param) and to_sequence(out).
        self.head_exchange = None

    # The input projections' names (``init_projections``, ``project``): initialized alike, split by heads.
    projections = ("wqkv", "wz", "wb", "wa")

    def init_projections(self, dim: int, la: LinearAttentionArgs) -> None:
        self.wqkv = nn.Linear(dim, la.conv_dim, bias=False)
        self.wz = nn.Linear(dim, la.value_dim, bias=False)
        self.wb = nn.Linear(dim, la.num_value_heads, bias=False)
        self.wa = nn.Linear(dim, la.num_value_heads, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, dim) -> the conv's input (B, T, 2 key_dim + value_dim), per key-head group; the gate z
        (B, T, value_dim); b and a (B, T, H_v), beta's and the decay's logits."""
        return self.wqkv(x), self.wz(x), self.wb(x), self.wa(x)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,
        attn_mask: torch.Tensor | BlockMask | None = None,
    ) -> torch.Tensor:
        """x (B, T, dim); ``rope`` is unused (no positions: the recurrence orders the tokens)."""
        la = self.la
        bsz, seqlen, _ = x.shape
        scan = self.sequence_scan if input_pos is None else None
        heads = self.head_exchange if input_pos is None else None
        mixed, z, b, a = self.project(x)
        conv_weight, a_log, dt_bias = local(self.conv.weight), local(self.a_log), local(self.dt_bias)
        if heads is not None:  # every position, a share of the heads: the conv and the rule run unchanged
            mixed, b, a = heads.to_heads(mixed, b, a)
            conv_weight, a_log, dt_bias = (heads.share(t) for t in (conv_weight, a_log, dt_bias))
        length = mixed.shape[1]  # the positions the conv and the rule see: seqlen, or all under head_exchange
        starts = document_starts(attn_mask, bsz, length, x.device) if input_pos is None and scan is None else None
        state = None
        if input_pos is not None:  # decoding: continue from the cache (fresh when the sequence restarts)
            fresh = (input_pos[0] != 0).to(x.dtype)
            window = self.cache.window * fresh
            state = self.cache.state * fresh
            conv_out = causal_conv(mixed, conv_weight, None, window)
            seen = torch.cat([window, mixed.to(window.dtype)], dim=1)  # (B, K - 1 + T, C)
            self.cache.window.copy_(seen[:, seen.shape[1] - (la.conv_kernel - 1):])  # the last K - 1 inputs
        elif scan is not None:
            conv_out = scan.conv(mixed, conv_weight, attn_mask)
        else:
            conv_out = causal_conv(mixed, conv_weight, starts)
        groups = la.num_value_heads // la.num_key_heads
        by_group = conv_out.reshape(bsz, length, -1, 2 * la.key_head_dim + groups * la.value_head_dim)
        q, k, v = by_group.split([la.key_head_dim, la.key_head_dim, groups * la.value_head_dim], dim=-1)
        v = v.reshape(bsz, length, -1, la.value_head_dim)  # (B, T, H_v, dv): q, k (B, T, H_k, dk)
        if groups > 1:
            q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)  # (B, T, H_v, dk)
        fp = compute_dtype(x.dtype)
        q = _l2_normalize(q.to(fp)) / math.sqrt(la.key_head_dim)
        k = _l2_normalize(k.to(fp))
        beta = torch.sigmoid(b.to(fp))  # (B, T, H_v)
        g = -a_log.to(fp).exp() * F.softplus(a.to(fp) + dt_bias.to(fp))
        if scan is not None:
            out = scan.rule(q, k, v.to(fp), g, beta, attn_mask)
        else:
            rule = recurrent_gated_delta_rule if input_pos is not None and seqlen == 1 else chunk_gated_delta_rule
            out, state = rule(q, k, v.to(fp), g, beta, resets=starts, initial_state=state)
        if input_pos is not None:
            self.cache.state.copy_(state)
        if heads is not None:
            out = heads.to_sequence(out)  # (B, T / cp, H_v, dv): this rank's positions again, every head
        z = z.reshape(bsz, seqlen, -1, la.value_head_dim)
        # The references' order: normalize (fp32) what the rule returns in the activations' dtype, cast, scale,
        # then gate in fp32.
        out = (self.norm(out.to(z.dtype)) * F.silu(z.to(fp))).to(x.dtype)  # (B, T, H_v, dv)
        return self.out_proj(out.reshape(bsz, seqlen, -1))  # (B, T, dim)

    def new_cache(self, batch_size: int, max_seq_len: int) -> GatedDeltaNetCache:
        """A zeroed decoding state of this layer's conv channels and value heads (a sharded layer: this rank's)."""
        weight = local(self.conv.weight)
        la = self.la
        return GatedDeltaNetCache(batch_size, la.conv_kernel, weight.shape[0], local(self.dt_bias).shape[0],
                                  la.key_head_dim, la.value_head_dim, weight.dtype, weight.device)

    def param_inits(self, depth: int) -> dict[str, ParamInit]:
        bound = 1 / math.sqrt(self.la.conv_kernel)  # torch's Conv1d default (fan-in: K taps of one channel)
        return {
            **{f"{name}.weight": INPUT for name in self.projections},
            "conv.weight": ParamInit("uniform", bound=bound),
            "dt_bias": ONES,
            # log A uniform in [0, ln 16] (A from 1 to 16): per-head decay rates from slow to fast, as the
            # references draw A (theirs uniform in [0.01, 16]; log-uniform keeps to ParamInit's kinds)
            "a_log": ParamInit("uniform", bound=math.log(16.0) / 2, center=math.log(16.0) / 2),
            "out_proj.weight": output_projection(depth),
        }


def _l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def local(param: torch.Tensor) -> torch.Tensor:
    """A parameter as this rank's tensor (a head-sharded DTensor under tensor parallelism: its heads)."""
    return param.to_local() if hasattr(param, "to_local") else param

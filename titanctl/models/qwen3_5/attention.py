"""Qwen3.5's full-attention layers: grouped-query attention with QK norm, RoPE on the first
``partial_rope_dim`` channels of each head, and its output gated by sigmoid(a second half of wq).

Positions: the references rotate by MRoPE, three position rows (time, height, width) whose
frequencies interleave (``mrope_section``). For text every row holds the same 1-D position, so each
frequency turns by that one position whichever row it is read from, and MRoPE is plain "rotate half"
RoPE over the rotated channels. tests/unit/models/test_qwen3_5_parity.py checks it: logits equal
transformers' (which builds the three rows) with titanctl's 1-D table.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from titanctl.models.common.args import ModelArgs
from titanctl.models.common.attention import Attention, layer_mask
from titanctl.models.common.rope import apply_rope_halves, rope_for


def rotate_partial(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """"Rotate half" RoPE over x's first 2 x rope.shape[-2] channels; the rest pass unrotated."""
    rotated = 2 * rope.shape[-2]
    if rotated == x.shape[-1]:
        return apply_rope_halves(x, rope)
    return torch.cat([apply_rope_halves(x[..., :rotated], rope), x[..., rotated:]], dim=-1)


class GatedAttention(Attention):
    def __init__(self, args: ModelArgs, layer_id: int = 0):
        super().__init__(args, layer_id)
        # Per head: head_dim query rows, then head_dim gate rows (the published weights' order).
        self.wq = nn.Linear(args.dim, 2 * args.n_heads * args.head_dim, bias=args.attention_bias)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        input_pos: torch.Tensor | None = None,
        attn_mask: torch.Tensor | BlockMask | None = None,
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, gate = self.wq(x).view(bsz, seqlen, -1, 2 * self.head_dim).chunk(2, dim=-1)  # (B, T, H, hd) each
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)  # (B, T, H_kv, hd)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        rope = rope_for(rope, seqlen)
        q, k = rotate_partial(q, rope), rotate_partial(k, rope)
        if input_pos is not None:
            keys, values = self.cache.update(input_pos, k.transpose(1, 2), v.transpose(1, 2))
            out = self.attend_cached(q.transpose(1, 2), keys, values, self.cache.mask(input_pos, self.window))
        else:
            mask = layer_mask(attn_mask, self.layer_type, self.window, seqlen, x.device)
            out = self.kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        out = out.transpose(1, 2) * torch.sigmoid(gate)  # (B, T, H, hd)
        return self.wo(out.reshape(bsz, seqlen, -1))

"""Rotary position embeddings: one table of (cos, sin) per (position, channel pair), two layouts.

The table is the same for both layouts, (max_seq_len, head_dim // 2, 2), so whatever shards or
slices it by position (context parallel, decoding) needs no knowledge of the layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from titanctl.models.common.args import ROPE_LAYOUTS, ModelArgs, RopeScaling


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


def apply_rope_halves(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate channel i with channel i + head_dim/2 (Hugging Face's "rotate_half" layout).

    x: (B, T, H, head_dim); rope: (T, head_dim // 2, 2). Computed in fp32 like ``apply_rope``.
    """
    first, second = x.float().chunk(2, dim=-1)  # (B, T, H, head_dim // 2) each
    cos, sin = rope[None, :, None, :, 0], rope[None, :, None, :, 1]  # (1, T, 1, head_dim // 2)
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return rotated.type_as(x)  # (B, T, H, head_dim)


ROPE_FUNCTIONS = {"interleaved": apply_rope, "halves": apply_rope_halves}  # keyed like ROPE_LAYOUTS


def rope_function(args: ModelArgs) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The rotation of ``args.rope_layout``."""
    if args.rope_layout not in ROPE_FUNCTIONS:
        raise ValueError(f"ModelArgs.rope_layout {args.rope_layout!r} is not one of {', '.join(ROPE_LAYOUTS)}")
    return ROPE_FUNCTIONS[args.rope_layout]

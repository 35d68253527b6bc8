"""Rotary position embeddings: one table of (cos, sin) per (position, channel pair), two layouts.

The table is the same for both layouts, (max_seq_len, head_dim // 2, 2), so whatever shards or
slices it by position (context parallel, decoding) needs no knowledge of the layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from titanctl.models.common.args import ROPE_LAYOUTS, ModelArgs, RopeScaling, YarnScaling


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Rotation frequency of each pair of channels, with frequency-dependent scaling (``RopeScaling``)."""
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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's temperature for a context ``factor`` times the original (1 when not extended)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(rope_dim: int, theta: float, yarn: YarnScaling) -> tuple[torch.Tensor, float]:
    """Rotation frequency of each pair of channels under YaRN, and the factor on cos and sin.

    In fp32, operation for operation as transformers' ``_compute_yarn_parameters`` (5.23) computes
    them, so the tables are equal to the bit; ``mscale`` or ``mscale_all_dim`` 0 means not given.
    """
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    extrapolated = 1.0 / pos_freqs  # the original frequencies: kept for the fast-rotating pairs
    interpolated = 1.0 / (yarn.factor * pos_freqs)  # slowed down: for pairs that turn less than once

    def pair_of(rotations: float) -> float:
        """The (fractional) pair that turns ``rotations`` times over the original context."""
        turns = yarn.original_max_position_embeddings / (rotations * 2 * math.pi)
        return rope_dim * math.log(turns) / (2 * math.log(theta))

    low, high = pair_of(yarn.beta_fast), pair_of(yarn.beta_slow)
    if yarn.truncate:  # whole pairs (truncate = false keeps the fractional ends)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    freqs = interpolated * (1 - keep) + extrapolated * keep
    if yarn.mscale and yarn.mscale_all_dim:
        attention_factor = yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(yarn.factor)
    return freqs, float(attention_factor)


def yarn_softmax_factor(yarn: YarnScaling | None) -> float:
    """The correction of the softmax scale under YaRN with ``mscale_all_dim``: mscale(factor, mscale_all_dim) squared
    (1 without YaRN or without mscale_all_dim)."""
    if yarn is None or not yarn.mscale_all_dim:
        return 1.0
    return yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2


def rope_table(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """cos and sin of every (position, pair): shape (max_seq_len, rope_dim // 2, 2)."""
    if args.yarn is not None:
        freqs, attention_factor = yarn_frequencies(args.rope_dim, args.rope_theta, args.yarn)
    else:
        freqs, attention_factor = rope_frequencies(args.rope_dim, args.rope_theta, args.rope_scaling), 1.0
    freqs = freqs.to(device)
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float32), freqs)
    table = torch.stack([angles.cos(), angles.sin()], dim=-1)
    return table if attention_factor == 1.0 else table * attention_factor


def rope_for(rope: torch.Tensor, seqlen: int) -> torch.Tensor:
    """The rows of ``rope`` for a sequence of ``seqlen`` tokens: the table's first ``seqlen`` rows
    (T, head_dim // 2, 2), or ``rope`` itself when it holds each token's own row already
    (B, T, head_dim // 2, 2: positions that restart inside the sequence, see ``Transformer.forward``)."""
    return rope[:seqlen] if rope.dim() == 3 else rope


def _cos_sin(rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin broadcast over heads: (1 or B, T, 1, head_dim // 2) each."""
    rows = rope if rope.dim() == 4 else rope[None]  # (1 or B, T, head_dim // 2, 2)
    return rows[:, :, None, :, 0], rows[:, :, None, :, 1]


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs (Meta's layout), real-valued so compile needs no complex ops.

    x: (B, T, H, head_dim); rope: (T, head_dim // 2, 2), or (B, T, head_dim // 2, 2) per token.
    """
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, T, H, head_dim // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = _cos_sin(rope)  # (1 or B, T, 1, head_dim // 2)
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


def apply_rope_halves(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate channel i with channel i + head_dim/2 (Hugging Face's "rotate_half" layout).

    x: (B, T, H, head_dim); rope: (T, head_dim // 2, 2), or (B, T, head_dim // 2, 2) per token. Computed
    in fp32 like ``apply_rope``.
    """
    first, second = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)  # (B, T, H, head_dim // 2)
    cos, sin = _cos_sin(rope)  # (1 or B, T, 1, head_dim // 2)
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return rotated.type_as(x)  # (B, T, H, head_dim)


ROPE_FUNCTIONS = {"interleaved": apply_rope, "halves": apply_rope_halves}  # keyed like ROPE_LAYOUTS


def rope_function(args: ModelArgs) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The rotation of ``args.rope_layout``."""
    if args.rope_layout not in ROPE_FUNCTIONS:
        raise ValueError(f"ModelArgs.rope_layout {args.rope_layout!r} is not one of {', '.join(ROPE_LAYOUTS)}")
    return ROPE_FUNCTIONS[args.rope_layout]

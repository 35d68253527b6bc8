"""Weights written back in their release's format: FP8 E4M3 blocks or packed FP4 experts, each against the
power-of-two (UE8M0) scales the release shipped, which the checkpoint carried.

A release whose block scales are UE8M0 (DeepSeek-V4's: ``fp4_experts`` names the sources) dequantizes exactly
in bf16 and fp32: every weight is a few significant bits times a power of two. Divided by the same scale it is
its stored FP8 or FP4 value again, exactly, so an export of untouched weights is the release bit for bit. A
trained weight rounds to the nearest value of its format at that scale (FP4: ties to the smaller magnitude);
one beyond the format's largest value at its block's scale saturates there, and is counted (``Requantized``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titanctl.checkpoint.quantized import fp4_experts

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
FP4_MAGNITUDES = torch.tensor(fp4_experts.FP4_VALUES[:8])  # 0 to 6: codes 0-7, the sign is bit 3
_MIDPOINTS = (FP4_MAGNITUDES[1:] + FP4_MAGNITUDES[:-1]) / 2  # a value at a midpoint takes the smaller magnitude
UE8M0 = torch.float8_e8m0fnu


@dataclass(frozen=True)
class Requantized:
    tensor: torch.Tensor  # FP8 E4M3, or int8 (two FP4 codes a byte)
    saturated: int  # values beyond the format's largest at their scale, written as that largest


def is_fp4(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> bool:
    """Whether scales of ``scale_shape`` are an FP4 expert's (one per row and 32 values) for an unpacked weight."""
    return tuple(scale_shape) == (*weight_shape[:-1], weight_shape[-1] // fp4_experts.GROUP) and \
        weight_shape[-1] % fp4_experts.GROUP == 0


def against(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> Requantized:
    """``weight`` (unquantized, any float dtype) in the format its carried ``scale`` belongs to: FP4 when the
    scales are one per row and 32 values, else FP8 blocks of ``block``."""
    if is_fp4(tuple(weight.shape), tuple(scale.shape)):
        return fp4(weight, scale)
    return fp8_blocks(weight, scale, block)


def fp8_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> Requantized:
    *_, rows, cols = weight.shape
    # Each scale over its block, cut to the weight (the last block of a dimension may be partial).
    spread = scale.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)[..., :rows, :cols]
    scaled = weight.float() / spread
    saturated = int((scaled.abs() > FP8_MAX).sum())
    return Requantized(scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8), saturated)


def fp4(weight: torch.Tensor, scale: torch.Tensor) -> Requantized:
    scaled = weight.float() / scale.float().repeat_interleave(fp4_experts.GROUP, dim=-1)
    magnitude = scaled.abs()
    saturated = int((magnitude > FP4_MAGNITUDES[-1]).sum())
    codes = torch.bucketize(magnitude, _MIDPOINTS)  # the nearest magnitude's code
    codes = codes | (torch.signbit(scaled).long() << 3)  # -0.0 keeps its sign bit, as stored
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # the low nibble: the even column
    return Requantized(packed.to(torch.uint8).view(torch.int8), saturated)


__all__ = ["Requantized", "UE8M0", "against", "fp4", "fp8_blocks", "is_fp4"]

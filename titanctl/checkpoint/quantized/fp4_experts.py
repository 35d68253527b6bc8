"""DeepSeek-V4's FP4 routed experts as published (deepseek-ai/DeepSeek-V4-Flash): paired, checked and
dequantized when read.

What the release holds, from the sources below (no offline source gives the published index itself):

- Every routed expert's ``layers.{i}.ffn.experts.{e}.w{1,2,3}.weight`` is ``int8`` of shape ``[out, in / 2]``:
  two FP4 E2M1 values a byte, the low nibble first (the value at an even column), each code sign bit 3, then
  two exponent bits and one mantissa bit (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives).
- Beside it ``layers.{i}.ffn.experts.{e}.w{1,2,3}.scale`` of shape ``[out, in / 32]``, ``float8_e8m0fnu``
  (UE8M0, safetensors ``F8_E8M0``): one power of two per row and 32 values along the input dimension.
- The other projections (attention, shared experts) are FP8 E4M3 with one UE8M0 ``.scale`` per 128 x 128 block
  (``titanctl.checkpoint.quantized.fp8_blocks``); the compressors' and the indexer's ``weights_proj`` are bf16.
- config.json: ``quantization_config`` ``{"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
  "weight_block_size": [128, 128], "activation_scheme": "dynamic"}``, and ``"expert_dtype": "fp4"`` at the top
  level (V4-Flash) or inside quantization_config (V4.1, and transformers' config after loading).

Sources: transformers 5.23 (the test venv): ``integrations/finegrained_fp8.py`` (``FP8Experts``: "weight is
int8, K dim halved (2 e2m1 values per byte), per-row SF at gran_k=32"; ``Fp8Dequantize._unpack_fp4``: the E2M1
table, low nibble first; its UE8M0 scales), ``quantizers/quantizer_finegrained_fp8.py`` ("Some FP8 checkpoints
ship per-block scales under ``.scale`` (e.g. DeepSeek-V4-Flash)"), ``utils/quantization_config.py``
(``FineGrainedFP8Config.scale_fmt`` "ue8m0 (1-byte torch.float8_e8m0fnu, V4-style)", ``expert_dtype`` "fp4 for
DeepSeek-V4's FP4-packed experts"), ``models/deepseek_v4/configuration_deepseek_v4.py`` ("V4.1 ships
expert_dtype in the quantization config") and ``modeling_deepseek_v4.py`` (the bf16 compressor projections).
Threads: anthony-chaudhary/fak#12639 (``wo_a.weight`` [8192, 4096] F8_E4M3, its ``.scale`` [64, 32] F8_E8M0;
"Scale companions use the .scale suffix, not .weight_scale_inv"), radixark/miles#2044 and #2717 (packed E2M1
``int8`` experts with per-(1, 32)-block UE8M0 scales, block-FP8 shared and dense weights), vllm-project/vllm#51946
(the experts' scales stored as ``float8_e8m0fnu``), bytedance-iaas/sglang#631 (group size 32 in the original).

Each value is an FP4 magnitude (two significant bits) times a power of two: exact in float32 and, within its
range, in bfloat16, so the dequantization is exact; it is computed in float32 and given the dtype asked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from titanctl.errors import CheckpointError

EXPERT_DTYPE = "fp4"
GROUP = 32  # FP4 values along the input dimension that share a scale (the release's)
PACKED_DTYPE = torch.int8  # two FP4 codes a byte
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_LUT = torch.tensor(FP4_VALUES, dtype=torch.float32)
ROWS_PER_CHUNK = 1 << 14  # rows decoded at a time: the float32 temporaries of a chunk, not of the matrix


def declared(config: dict[str, Any] | None) -> bool:
    """Whether a config.json declares FP4 experts (``expert_dtype: fp4``, at its top or in quantization_config)."""
    config = config or {}
    quantization = config.get("quantization_config")
    inner = quantization.get("expert_dtype") if isinstance(quantization, dict) else None
    return (inner or config.get("expert_dtype")) == EXPERT_DTYPE


def unpacked_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The weight a packed ``[..., out, in / 2]`` tensor holds: ``[..., out, in]``."""
    return (*shape[:-1], 2 * shape[-1])


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scales a packed ``[..., out, in / 2]`` tensor needs: ``[..., out, in / 32]``."""
    return (*shape[:-1], 2 * shape[-1] // GROUP)


def check_pair(key: str, shape: tuple[int, ...], scale_key: str, scale: tuple[int, ...], where: str) -> None:
    """One packed weight and its scales: a matrix whose unpacked width is whole groups of 32, and scales of
    the shape that needs; a one-line error names both tensors."""
    if len(shape) < 2 or (2 * shape[-1]) % GROUP:
        raise CheckpointError(f"FP4 tensor {key!r} in {where} has shape {shape}: packed FP4 experts are "
                              f"[out, in / 2] int8 with in a multiple of {GROUP} (one scale per {GROUP} values)")
    if tuple(scale) != scale_shape(shape):
        raise CheckpointError(f"tensor {scale_key!r} in {where} has shape {tuple(scale)}, but the FP4 tensor {key!r} "
                              f"of shape {shape} needs {scale_shape(shape)} (one scale per row and {GROUP} values)")


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes as the ``[..., 2n]`` FP4 values they hold, in float32 (the low nibble first)."""
    codes = packed.view(torch.uint8)
    return torch.stack([_LUT[(codes & 0x0F).long()], _LUT[(codes >> 4).long()]], dim=-1).flatten(-2)


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    release: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """The weight that ``packed`` (``[..., out, in / 2]`` int8) and ``scale`` (``[..., out, in / 32]``, any
    real dtype: float8_e8m0fnu as published) encode, in ``dtype`` (into ``out``), a chunk of rows at a time
    (``release(rows)`` hands each chunk's pages back once read)."""
    rows, width = packed.shape[:-1], 2 * packed.shape[-1]
    out = torch.empty(*rows, width, dtype=dtype) if out is None else out
    flat, flat_out = packed.reshape(-1, packed.shape[-1]), out.view(-1, width)
    flat_scale = scale.reshape(-1, scale.shape[-1]).float()
    for start in range(0, flat.shape[0], ROWS_PER_CHUNK):
        chunk = flat[start : start + ROWS_PER_CHUNK]  # (n, in / 2)
        values = unpack(chunk).unflatten(-1, (-1, GROUP))  # (n, in / 32, 32)
        products = values * flat_scale[start : start + ROWS_PER_CHUNK, :, None]
        if not torch.isfinite(products).all():
            row = int((~torch.isfinite(products)).flatten(1).any(1).nonzero()[0]) + start
            raise CheckpointError(f"FP4 tensor row {row} dequantizes to a value that is not finite: its scale "
                                  f"{flat_scale[row].max().item()} is out of range")
        flat_out[start : start + ROWS_PER_CHUNK] = products.flatten(-2)
        if release is not None:
            release(chunk)
    return out


__all__ = ["EXPERT_DTYPE", "GROUP", "check_pair", "declared", "dequantize", "scale_shape", "unpack",
           "unpacked_shape"]

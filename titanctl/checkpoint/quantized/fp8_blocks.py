"""Block-quantized FP8 weights (DeepSeek-V3's official release, transformers' "finegrained FP8").

Such a Hugging Face folder stores a linear weight ``X.weight`` as ``float8_e4m3fn`` and beside it
``X.weight_scale_inv`` (float32) of shape ``[ceil(out/b0), ceil(in/b1)]``, one scale per block of
``b0 x b1`` weights (``config.json``: ``quantization_config.weight_block_size``, [128, 128]; the
last block of a dimension may be partial). The real weight is ``weight.float() * scale`` with each
scale over its block, as DeepSeek's ``weight_dequant`` computes it: in float32, rounded once to the
dtype asked. Packed tensors (transformers 5's ``mlp.experts.gate_up_proj``) have leading dimensions;
their scales (``gate_up_proj_scale_inv``) have the same leading dimensions.

Pairing and every shape and dtype check read safetensors headers only; then every scale is read
once (they are 1/(b0 x b1) of the weights) and must be finite and positive: a NaN, infinite, zero or
negative scale would turn its block into NaN, infinite, zero or negated weights that convert writes
and training or generation runs on. All of this happens when a folder is opened, the one path that
``convert``, ``infer-tp`` and ``checkpoint.initial_load_path`` share. ``dequantize`` turns one weight
into real numbers a block of rows at a time, so memory holds the output and one block row beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titanctl.errors import CheckpointError

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv, X.gate_up_proj -> X.gate_up_proj_scale_inv
# DeepSeek-V4's release: X.weight beside X.scale (read as X.weight_scale_inv: ``published_scale_names``).
PUBLISHED_SCALE_SUFFIX = ".scale"
DEFAULT_BLOCK = (128, 128)  # DeepSeek-V3's, and transformers' default when the config names none
QUANT_METHOD = "fp8"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# What a scale may be stored as: real numbers (DeepSeek-V3 and transformers store float32). An integer
# scale (an int64 tensor of ones, say) would read as a number but is no quantizer's output.
# DeepSeek-V4 stores UE8M0 (float8_e8m0fnu: a power of two a byte).
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e8m0fnu)

Stored = tuple[str, Path, tuple[int, ...], torch.dtype]  # (key, file, shape, dtype) from a header


@dataclass(frozen=True)
class BlockScale:
    """Where the scales of one FP8 weight are stored."""

    key: str  # e.g. model.layers.0.self_attn.q_a_proj.weight_scale_inv
    path: Path  # the safetensors file that holds it


def declared_block_size(config: dict[str, Any] | None, where: str) -> tuple[int, int] | None:
    """``quantization_config.weight_block_size`` of a config.json, [128, 128] when the FP8 config
    names none; None when the config has no quantization_config. Any method but block FP8 is refused:
    its tensors would be read as if they were plain weights."""
    quantization = (config or {}).get("quantization_config")
    if quantization is None:
        return None
    if not isinstance(quantization, dict):
        raise CheckpointError(f"{where}: quantization_config is {quantization!r}, not an object")
    method = quantization.get("quant_method")
    if method == "mxfp4":  # gpt-oss's: titanctl.checkpoint.quantized.mxfp4 pairs those tensors
        return None
    if method != QUANT_METHOD:
        raise CheckpointError(
            f"{where}: quantization_config.quant_method {method!r} is not supported; titanctl reads "
            f"{QUANT_METHOD!r} (block-wise float8 weights beside their weight{SCALE_SUFFIX} scales) and 'mxfp4' "
            "(gpt-oss's FP4 *_blocks beside their *_scales)"
        )
    block = quantization.get("weight_block_size")
    if block is None:
        return DEFAULT_BLOCK
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise CheckpointError(
            f"{where}: quantization_config.weight_block_size {block!r} is not two positive integers, e.g. [128, 128]"
        )
    return block[0], block[1]


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scales a weight of ``weight_shape`` needs: one per block of its last two dimensions."""
    *leading, rows, cols = weight_shape
    return (*leading, -(-rows // block[0]), -(-cols // block[1]))


def published_scale_names(stored: Iterable[Stored]) -> dict[str, str]:
    """{``X.scale``: ``X.weight_scale_inv``} for the scales of a folder that spells them as DeepSeek-V4's
    release does: a ``.scale`` beside an ``X.weight`` that is FP8 (or int8: FP4 experts). Any other
    ``.scale`` (a norm's, say) is no block scale and keeps its name."""
    stored = list(stored)
    quantized = {key for key, _path, _shape, dtype in stored if dtype in (*FP8_DTYPES, torch.int8)}
    renames = {}
    for key, *_ in stored:
        weight = key.removesuffix(PUBLISHED_SCALE_SUFFIX) + ".weight"
        if key.endswith(PUBLISHED_SCALE_SUFFIX) and weight in quantized:
            renames[key] = weight + SCALE_SUFFIX
    return renames


def pair_scales(stored: Iterable[Stored], block: tuple[int, int], folder: Path,
                file_names: dict[str, str] | None = None) -> dict[str, BlockScale]:
    """{FP8 weight key: its scales} for the tensors of a folder, every pairing, shape and value checked
    (one-line errors naming the tensor and both shapes): an FP8 weight without scales, scales without
    their weight or beside a weight that is not FP8, scales of the wrong shape or dtype, and scales
    that are not all finite and positive are refused. ``file_names``: how the files spell the keys that
    ``stored`` renames (a published folder's)."""
    stored = list(stored)
    by_key = {key: (path, shape, dtype) for key, path, shape, dtype in stored}
    pairs: dict[str, BlockScale] = {}
    for key, path, shape, dtype in stored:
        if not key.endswith(SCALE_SUFFIX):
            continue
        weight_key = key.removesuffix(SCALE_SUFFIX)
        where = path.relative_to(folder)
        if weight_key not in by_key:
            raise CheckpointError(f"tensor {key!r} in {where} (shape {shape}) scales {weight_key!r}, which the "
                                  "checkpoint lacks")
        _weight_path, weight_shape, weight_dtype = by_key[weight_key]
        if weight_dtype not in FP8_DTYPES:
            raise CheckpointError(f"tensor {key!r} in {where} scales {weight_key!r} (shape {weight_shape}), which is "
                                  f"{weight_dtype}, not FP8")
        if len(weight_shape) < 2:
            raise CheckpointError(f"FP8 tensor {weight_key!r} has shape {weight_shape}: block scales need a matrix")
        if dtype not in SCALE_DTYPES:
            stored_as = str(dtype).removeprefix("torch.")
            raise CheckpointError(
                f"tensor {key!r} in {where} is {stored_as}: block scales are real numbers (float32 as DeepSeek-V3 "
                f"stores them), so {weight_key!r} cannot be dequantized with it"
            )
        expected = scale_shape(weight_shape, block)
        if tuple(shape) != expected:
            raise CheckpointError(
                f"tensor {key!r} in {where} has shape {tuple(shape)}, but {weight_key!r} of shape {weight_shape} "
                f"needs {expected} ({block[0]}x{block[1]} blocks)"
            )
        pairs[weight_key] = BlockScale(key, path)
    for key, path, shape, dtype in stored:
        if dtype in FP8_DTYPES and key not in pairs:
            raise CheckpointError(f"FP8 tensor {key!r} in {path.relative_to(folder)} (shape {shape}) has no "
                                  f"{key + SCALE_SUFFIX!r}: block-quantized weights need their scales")
    check_scale_values(pairs, folder, file_names)
    return pairs


def check_scale_values(pairs: dict[str, BlockScale], folder: Path, file_names: dict[str, str] | None = None) -> None:
    """Every scale finite and > 0 (each is a block's largest |weight| over the FP8 maximum), read one
    tensor at a time, each file opened once; a one-line error names the tensor, the block and the value."""
    from safetensors import SafetensorError, safe_open

    by_file: dict[Path, list[tuple[str, str]]] = {}
    for weight_key, scale in pairs.items():
        by_file.setdefault(scale.path, []).append((scale.key, weight_key))
    for path, keys in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                for key, weight_key in keys:
                    scale = f.get_tensor((file_names or {}).get(key, key)).float()  # UE8M0 has no isfinite of its own
                    bad = ~(torch.isfinite(scale) & (scale > 0))
                    if bad.any():
                        block = tuple(bad.nonzero()[0].tolist())
                        value = scale[block].item()
                        raise CheckpointError(
                            f"tensor {key!r} in {path.relative_to(folder)} holds {value} at block {block}: a block "
                            f"scale must be finite and > 0, else {weight_key!r} dequantizes to "
                            f"{_what_it_makes(value)}"
                        )
        except SafetensorError as e:
            raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None


def _what_it_makes(value: float) -> str:
    if value != value:
        return "NaN weights"
    if value in (float("inf"), float("-inf")):
        return "infinite weights"
    return "zeros" if value == 0 else "negated weights"


def dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    release: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """``weight.float() * scale`` (each scale over its ``block``), rounded once to ``dtype``, into
    ``out`` (a new tensor if None). ``release(rows)`` is called on each block of weight rows once read
    (to hand a memory-mapped file's pages back), so the FP8 input is never resident whole."""
    *leading, rows, cols = weight.shape
    row_block, col_block = block
    out = torch.empty(weight.shape, dtype=dtype) if out is None else out
    # One matrix at a time, so the float32 temporary is one block of rows of one matrix.
    matrices, outputs = weight.reshape(-1, rows, cols), out.view(-1, rows, cols)
    # Each scale repeated over its block's columns: (matrices, row blocks, cols), 1/row_block of the weight.
    column_scales = scale.reshape(-1, *scale.shape[-2:]).float().repeat_interleave(col_block, dim=-1)[..., :cols]
    for matrix, matrix_out, matrix_scales in zip(matrices, outputs, column_scales, strict=True):
        for start in range(0, rows, row_block):
            block_rows = matrix[start : start + row_block]  # (<= row_block, cols)
            matrix_out[start : start + row_block] = block_rows.float() * matrix_scales[start // row_block]
            if release is not None:
                release(block_rows)
    return out


__all__ = [
    "DEFAULT_BLOCK", "PUBLISHED_SCALE_SUFFIX", "BlockScale", "check_scale_values", "declared_block_size",
    "dequantize", "pair_scales", "published_scale_names", "scale_shape",
]

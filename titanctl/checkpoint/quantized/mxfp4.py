"""MXFP4 weights (openai/gpt-oss-20b and -120b as published; ``quantization_config.quant_method: mxfp4``).

Such a Hugging Face folder stores a matrix ``X`` as two uint8 tensors: ``X_blocks`` (..., rows, G, 16),
each byte two FP4 E2M1 values (the low nibble first), 32 values per block, and ``X_scales`` (..., rows, G),
one E8M0 exponent per block (the block's values times 2^(scale - 127); 255 is NaN in the OCP MX format).
Decoded, a matrix is (..., rows, G x 32); transformers then swaps its last two dimensions (gpt-oss's
experts: ``gate_up_proj`` (E, dim, 2 x hidden), ``down_proj`` (E, hidden, dim)), and so does this reader:
``X`` is read as if the folder held that tensor, named and shaped so.

Each value is an FP4 magnitude (0, 0.5, 1, 1.5, 2, 3, 4 or 6, two significant bits at most) times a power
of two, computed in float32 where it is exact, then given the dtype asked; float32 and bfloat16 hold every
such value that is finite (their exponent range reaches 2^-133 and beyond), so the dequantization is exact.
Pairing and every shape and dtype check read safetensors headers only; the scales are then read once (1/16
of the blocks' bytes) and a NaN exponent (255) refused. ``dequantize`` turns one matrix into real numbers a
chunk of rows at a time and refuses a value that is not finite in the dtype asked (a large exponent times a
large FP4 value), so the output and one chunk are resident, never the whole model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titanctl.errors import CheckpointError

QUANT_METHOD = "mxfp4"
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
BLOCK_BYTES = 16  # 32 FP4 values per block, two per byte
SCALE_BIAS = 127
NAN_SCALE = 255  # E8M0's NaN
# FP4 E2M1 by its 4-bit code: sign bit 3, then 2 exponent bits and 1 mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Dtypes that hold every finite MXFP4 value exactly.
EXACT_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
ROWS_PER_CHUNK = 1 << 16  # decoded rows of 32 x G values at a time: a few MB of temporaries per chunk

Stored = tuple[str, Path, tuple[int, ...], torch.dtype]  # (key, file, shape, dtype) from a header


@dataclass(frozen=True)
class Packed:
    """Where the blocks and scales of one MXFP4 matrix are stored."""

    name: str  # the tensor they encode, e.g. model.layers.0.mlp.experts.gate_up_proj
    blocks: str
    blocks_path: Path
    scales: str
    scales_path: Path
    shape: tuple[int, ...]  # of the decoded tensor, its last two dimensions swapped (transformers')


def check_finite(tensor: torch.Tensor, name: str, where: Path) -> torch.Tensor:
    """A tensor stored beside MXFP4 blocks (attention sinks, biases, norms, the router) whose values are
    all finite, as the decoded blocks' are: checked a few million values at a time (a boolean temporary
    of that size), so a NaN sink is refused naming it instead of copied into the checkpoint."""
    if tensor.is_floating_point() and tensor.numel():
        rows = max(1, (1 << 24) // max(1, tensor[0].numel())) if tensor.dim() else 1
        for chunk in tensor.split(rows) if tensor.dim() else (tensor,):
            if not torch.isfinite(chunk).all():
                raise CheckpointError(f"{where}: tensor {name!r} holds a value that is not finite (NaN or infinity); "
                                      "a model holding it computes NaN")
    return tensor


def declared(config: dict[str, Any] | None) -> bool:
    """Whether a config.json declares MXFP4 weights."""
    quantization = (config or {}).get("quantization_config")
    return isinstance(quantization, dict) and quantization.get("quant_method") == QUANT_METHOD


def pair_blocks(stored: Iterable[Stored], folder: Path, config_declares: bool) -> dict[str, Packed]:
    """{decoded tensor name: its blocks and scales} for the tensors of a folder, every pairing, dtype and
    shape checked from the headers and every scale read once: blocks without scales or scales without
    blocks, a dtype other than uint8, shapes that do not pair, a NaN exponent, and MXFP4 tensors in a folder
    whose config.json does not declare ``quant_method: mxfp4`` are refused in one line."""
    stored = list(stored)
    by_key = {key: (path, shape, dtype) for key, path, shape, dtype in stored}
    packed: dict[str, Packed] = {}
    for key, path, shape, dtype in stored:
        if key.endswith(SCALES_SUFFIX) and key.removesuffix(SCALES_SUFFIX) + BLOCKS_SUFFIX not in by_key:
            raise CheckpointError(f"tensor {key!r} in {path.relative_to(folder)} (shape {shape}) holds MXFP4 scales "
                                  f"of {key.removesuffix(SCALES_SUFFIX) + BLOCKS_SUFFIX!r}, which the checkpoint lacks")
        if not key.endswith(BLOCKS_SUFFIX):
            continue
        name = key.removesuffix(BLOCKS_SUFFIX)
        scales_key = name + SCALES_SUFFIX
        where = path.relative_to(folder)
        if not config_declares:
            raise CheckpointError(f"tensor {key!r} in {where} is MXFP4 blocks, but config.json does not declare "
                                  f"quantization_config.quant_method {QUANT_METHOD!r}")
        if scales_key not in by_key:
            raise CheckpointError(f"MXFP4 tensor {key!r} in {where} (shape {shape}) has no {scales_key!r}: its "
                                  "blocks need their scales")
        scales_path, scales_shape, scales_dtype = by_key[scales_key]
        for what, k, d in (("blocks", key, dtype), ("scales", scales_key, scales_dtype)):
            if d != torch.uint8:
                raise CheckpointError(f"tensor {k!r} is {str(d).removeprefix('torch.')}: MXFP4 {what} are uint8 "
                                      f"({'two FP4 values per byte' if what == 'blocks' else 'E8M0 exponents'})")
        if len(shape) < 3 or shape[-1] != BLOCK_BYTES:
            raise CheckpointError(f"MXFP4 tensor {key!r} in {where} has shape {shape}, expected (..., rows, blocks, "
                                  f"{BLOCK_BYTES}): 32 FP4 values per block")
        if tuple(scales_shape) != tuple(shape[:-1]):
            raise CheckpointError(f"tensor {scales_key!r} has shape {tuple(scales_shape)}, but {key!r} of shape "
                                  f"{shape} needs {tuple(shape[:-1])} (one scale per block)")
        *lead, rows, groups, _ = shape
        packed[name] = Packed(name, key, path, scales_key, scales_path, (*lead, groups * 2 * BLOCK_BYTES, rows))
    check_scale_values(packed, folder)
    return packed


def check_scale_values(packed: dict[str, Packed], folder: Path) -> None:
    """No scale is E8M0's NaN (255): read one tensor at a time, each file opened once; a one-line error
    names the tensor, the block and the value."""
    from safetensors import SafetensorError, safe_open

    by_file: dict[Path, list[str]] = {}
    for entry in packed.values():
        by_file.setdefault(entry.scales_path, []).append(entry.scales)
    for path, keys in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in keys:
                    bad = f.get_tensor(key) == NAN_SCALE
                    if bad.any():
                        block = tuple(bad.nonzero()[0].tolist())
                        raise CheckpointError(
                            f"tensor {key!r} in {path.relative_to(folder)} holds {NAN_SCALE} at block {block}: "
                            f"E8M0's NaN, an MXFP4 scale out of range (0 to {NAN_SCALE - 1}, 2^-127 to 2^127)"
                        )
        except SafetensorError as e:
            raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None


def check_dtype(dtype: torch.dtype) -> None:
    """MXFP4 weights dequantize exactly to float32 or bfloat16 only (float16's exponents stop at 2^-24)."""
    if dtype not in EXACT_DTYPES:
        raise CheckpointError(f"MXFP4 weights dequantize exactly to float32 or bfloat16, not "
                              f"{str(dtype).removeprefix('torch.')} (its range is narrower): choose one of them")


_LUT = torch.tensor(FP4_VALUES, dtype=torch.float32)
# 2^(s - 127) for every exponent byte, exact in float32 (2^-127 is subnormal there; 255 is refused before).
_POWERS = torch.tensor([2.0 ** (s - SCALE_BIAS) for s in range(NAN_SCALE)] + [float("nan")], dtype=torch.float32)


def dequantize(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype,
    name: str,
    release: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """The matrices of ``blocks`` (..., rows, G, 16) uint8 and ``scales`` (..., rows, G) uint8 as real
    numbers (..., rows, G x 32) in ``dtype``, a chunk of rows at a time (``release(chunk)`` hands each
    chunk's pages back once read). A value that is not finite in ``dtype`` is refused, naming ``name``."""
    *lead, rows, groups, _ = blocks.shape
    out = torch.empty(*lead, rows, groups * 2 * BLOCK_BYTES, dtype=dtype)
    flat_blocks, flat_scales = blocks.reshape(-1, groups, BLOCK_BYTES), scales.reshape(-1, groups)
    flat_out = out.view(-1, groups * 2 * BLOCK_BYTES)
    for start in range(0, flat_blocks.shape[0], ROWS_PER_CHUNK):
        chunk = flat_blocks[start : start + ROWS_PER_CHUNK]  # (n, G, 16)
        codes = torch.stack([chunk & 0x0F, chunk >> 4], dim=-1).long()  # (n, G, 16, 2): low nibble first
        values = _LUT[codes].flatten(-2) * _POWERS[flat_scales[start : start + ROWS_PER_CHUNK].long()][..., None]
        converted = values.to(dtype)  # exact where finite (EXACT_DTYPES)
        if not torch.isfinite(converted).all():
            row, group = (~torch.isfinite(converted)).any(dim=-1).nonzero()[0].tolist()
            index = (*_unravel(start + row, lead, rows), group)
            raise CheckpointError(
                f"MXFP4 tensor {name!r} decodes to a value that is not finite in {str(dtype).removeprefix('torch.')} "
                f"at block {index} (exponent {int(flat_scales[start + row, group]) - SCALE_BIAS}): a malformed scale"
            )
        flat_out[start : start + ROWS_PER_CHUNK] = converted.flatten(-2)
        if release is not None:
            release(chunk)
    return out


def _unravel(flat_row: int, lead: list[int], rows: int) -> tuple[int, ...]:
    index = []
    for size in reversed([*lead, rows]):
        index.append(flat_row % size)
        flat_row //= size
    return tuple(reversed(index))


__all__ = ["QUANT_METHOD", "Packed", "check_dtype", "check_scale_values", "declared", "dequantize", "pair_blocks"]

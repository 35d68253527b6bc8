"""What survives of a training update when DeepSeek-V4's weights are written back in the release's format
(against the UE8M0 scales it shipped: ``titanctl.checkpoint.quantized.requantize``).

A unit-scale random matrix is quantized as the release would be (FP8 E4M3 with one power-of-two scale per
128 x 128 block; FP4 E2M1 with one per row and 32 values), dequantized, moved by ``--move`` (relative rms),
rounded through bf16 (the run's dtype) and written back. Printed per format: the written weight's relative rms
error against the moved one, the fraction of the move that survives (the written weight's distance from the
shipped one over the move's), the values saturated, and whether the bytes are the shipped ones.

    PYTHONPATH=. .venv/bin/python benchmarks/requantize_error.py [--move 0.01] [--rows 512] [--cols 1024]
"""

from __future__ import annotations

import argparse

import torch

from titanctl.checkpoint.quantized import fp4_experts
from titanctl.checkpoint.quantized.fp8_blocks import dequantize
from titanctl.checkpoint.quantized.requantize import FP4_MAGNITUDES, against


def power_of_two(amax: torch.Tensor, largest: float) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2((amax / largest).clamp(min=2.0**-100))))


def shipped_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    blocks = w.reshape(rows // 128, 128, cols // 128, 128)
    scale = power_of_two(blocks.abs().amax(dim=(1, 3)), 448.0)
    return (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn), scale


def shipped_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = power_of_two(w.reshape(w.shape[0], -1, 32).abs().amax(dim=-1), 6.0)
    return against(w, scale, (128, 128)).tensor, scale  # nearest FP4 value at that scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--move", type=float, default=0.01)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--cols", type=int, default=1024)
    opts = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(opts.rows, opts.cols, generator=gen) / opts.cols**0.5
    formats = {
        "fp8 128x128": (shipped_fp8, lambda q, s: dequantize(q, s, (128, 128), torch.float32)),
        "fp4 1x32": (shipped_fp4, lambda q, s: fp4_experts.dequantize(q, s, torch.float32)),
    }
    assert FP4_MAGNITUDES[-1] == 6.0
    for name, (ship, read) in formats.items():
        stored, scale = ship(w)
        shipped = read(stored, scale)
        moved = (shipped * (1 + opts.move * torch.randn(shipped.shape, generator=gen))).to(torch.bfloat16).float()
        written = against(moved, scale, (128, 128))
        back = read(written.tensor, scale)
        error = ((back - moved).norm() / moved.norm()).item()
        kept = ((back - shipped).norm() / (moved - shipped).norm()).item()
        same = torch.equal(written.tensor.view(torch.uint8), stored.view(torch.uint8))
        print(f"{name}: moved {opts.move:.1%}  written rel rms error {error:.2e}  move surviving {kept:.2f}x  "
              f"saturated {written.saturated}/{moved.numel()}  bytes as shipped: {same}")


if __name__ == "__main__":
    main()

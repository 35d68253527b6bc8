"""FLOPs per token and the device peak that MFU divides by."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from titanctl.models.llama.args import ModelArgs

# Dense bf16 TFLOP/s without sparsity, by the device name torch reports.
GPU_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,  # SXM
    "H20": 148.0,
    "A100": 312.0,
    "A10G": 125.0,
    "L40S": 362.0,
    "L4": 121.0,
    "B200": 2250.0,
    "GB200": 2500.0,
    "MI300X": 1307.0,
    "MI250X": 383.0,
}


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls of N non-embedding parameters, plus
    12·L·H·Q·T for attention scores and values (forward + backward)."""
    n = args.num_params(include_embedding=False)
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


def gpu_peak_tflops(name: str) -> float | None:
    for key, tflops in GPU_PEAK_TFLOPS.items():  # ordered: specific names first
        if key in name:
            return tflops
    return None


def _cache_dir() -> Path:
    return Path(os.environ.get("TITANCTL_CACHE_DIR") or Path.home() / ".cache" / "titanctl")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_peak_tflops(dtype: torch.dtype = torch.float32, threads: int | None = None) -> float:
    """Matmul TFLOP/s of this CPU in ``dtype`` at the current thread count, measured once and cached.

    Measured rather than looked up: whether bf16 is fast depends on the CPU (AMX / AVX512-BF16).
    """
    threads = threads or torch.get_num_threads()
    key = f"{_cpu_model()}|{os.cpu_count()} cpus|{threads} threads|{dtype}"
    cache = _cache_dir() / "cpu_peak_tflops.json"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    n = 2048
    gen = torch.Generator().manual_seed(0)  # never touch the run's global RNG state
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    a @ b  # warm up the kernel choice
    best = float("inf")
    for _ in range(8):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    known[key] = round(2 * n**3 / best / 1e12, 4)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known, indent=1))
    tmp.replace(cache)
    return known[key]


def device_peak_tflops(device: torch.device, dtype: torch.dtype, configured: float = 0.0) -> float | None:
    """Peak TFLOP/s for MFU; None for a GPU we have no figure for (set metrics.peak_tflops)."""
    if configured > 0:
        return configured
    if device.type == "cuda":
        return gpu_peak_tflops(torch.cuda.get_device_name(device))
    return cpu_peak_tflops(dtype)

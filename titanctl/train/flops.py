"""FLOPs per token and the device peak that MFU divides by."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from titanctl.models.llama.args import ModelArgs
from titanctl.models.llama.shapes import num_params
from titanctl.parallel.onednn_linear import onednn_available, onednn_mm_t

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
    """Training FLOPs per token of the whole model: 6N for the matmuls of its N parameters
    outside the embedding table (forward 2N, backward 4N; the output layer counts), plus
    12·L·H·Q·T for attention scores and values (4·T·Q per head and layer forward, 3x with
    backward; causal masking halves the work actually done, which this formula, like
    torchtitan's, does not credit).

    N is the whole model's, also under TP and PP, where each device holds a part of it: the
    throughput it multiplies is per device too (tokens of the global batch / world size), and
    a device that holds 1/(tp·pp) of the model and sees 1/cp of a sequence does that share of
    the work of its data-parallel rank's tokens.
    """
    n = num_params(args, include_embedding=False)
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


@dataclass(frozen=True)
class Throughput:
    step_time: float  # seconds per optimizer step
    tps: float  # tokens per second per device
    tflops: float  # achieved TFLOP/s per device
    mfu: float | None  # % of the device's peak; None without a peak figure


def throughput(
    global_tokens_per_step: int, steps: int, seconds: float, world_size: int, flops_per_token: float,
    peak_tflops: float | None,
) -> Throughput:
    """Per-device rates of ``steps`` optimizer steps that took ``seconds``.

    Every device of the job shares the work of the global batch, whatever the layout: divide by
    the world size (data-parallel ranks x tp x pp x cp), as torchtitan does.
    """
    step_time = seconds / steps
    tps = global_tokens_per_step / step_time / world_size
    tflops = tps * flops_per_token / 1e12
    mfu = 100 * tflops / peak_tflops if peak_tflops else None
    return Throughput(step_time, tps, tflops, mfu)


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
    The faster of torch's matmul and oneDNN's (which fp32 linears use on CPU, see
    titanctl.parallel.onednn_linear; on AMD CPUs it is about twice MKL's), so that MFU stays <= 100%.
    """
    threads = threads or torch.get_num_threads()
    key = f"{_cpu_model()}|{os.cpu_count()} cpus|{threads} threads|{dtype}|aten+onednn"
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
    kernels = [torch.mm]
    if onednn_available():
        kernels.append(lambda x, y: onednn_mm_t(x, y.t()))
    best = float("inf")
    for matmul in kernels:
        matmul(a, b)  # warm up the kernel choice
        for _ in range(8):
            start = time.perf_counter()
            matmul(a, b)
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

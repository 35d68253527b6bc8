"""The device peak that MFU divides by: a property of the hardware, never of the load.

GPUs: the datasheet's dense figure, by the name torch reports. CPUs: cores x clock x FLOPs per
cycle per core of the widest units the CPU has for the compute dtype, read from the operating
system (/proc/cpuinfo flags, cpufreq, topology) at no cost. Nothing is timed: a timed matmul
measures the load of the moment (cached once on a busy machine, it made every later run print MFU
over 100%), and on a CPU without bf16 units a bf16 probe alone takes minutes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

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

# FLOPs per cycle per core (a fused multiply-add counts 2), by the units a CPU flag promises, as
# (flag, FLOPs) from the widest down. x86 cores issue two vector FMAs per cycle at most (one on
# some parts: the figure is an upper bound, so that MFU cannot pass 100%); AMX tiles do 1024 bf16
# or fp16 FLOPs per cycle. Without units for a 16-bit type, it runs at most at the fp32 rate.
_X86_FP32 = (("avx512f", 2 * 16 * 2), ("fma", 2 * 8 * 2), ("avx", 8 + 8), ("sse2", 4 + 4))
_X86_16BIT = {
    torch.bfloat16: (("amx_bf16", 1024), ("avx512_bf16", 2 * 32 * 2)),
    torch.float16: (("amx_fp16", 1024), ("avx512_fp16", 2 * 32 * 2)),
}
# Arm: up to four 128-bit FMA pipes (Neoverse V-series); BFMMLA does 4x the fp32 work per
# instruction, half-precision FMAs 2x.
_ARM_FP32 = (("asimd", 4 * 4 * 2),)
_ARM_16BIT = {torch.bfloat16: (("bf16", 4 * 32),), torch.float16: (("asimdhp", 2 * 32),)}


@dataclass(frozen=True)
class CpuPeak:
    cores: int
    ghz: float
    flops_per_cycle: int

    @property
    def tflops(self) -> float:
        return self.cores * self.ghz * self.flops_per_cycle / 1e3

    def describe(self) -> str:
        return f"{self.cores} cores x {self.ghz:.2f} GHz x {self.flops_per_cycle} FLOPs/cycle"


def gpu_peak_tflops(name: str) -> float | None:
    for key, tflops in GPU_PEAK_TFLOPS.items():  # ordered: specific names first
        if key in name:
            return tflops
    return None


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The first CPU's feature flags (x86 ``flags``, Arm ``Features``)."""
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


SYSFS_CPU = Path("/sys/devices/system/cpu")


def _cpu_ghz(cpuinfo: str, cpus: list[int], sysfs: Path) -> float | None:
    """The highest clock the OS reports for these CPUs: cpufreq's maximum (boost included, on
    bare metal), the clock in the model name, or the current 'cpu MHz' (a VM's base clock)."""
    ghz = []
    for cpu in cpus:
        try:
            ghz.append(int((sysfs / f"cpu{cpu}/cpufreq/cpuinfo_max_freq").read_text()) / 1e6)
        except (OSError, ValueError):
            pass
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "cpu MHz":
            try:
                ghz.append(float(value) / 1e3)
            except ValueError:
                pass
        elif key.strip() == "model name" and (m := re.search(r"@\s*([\d.]+)\s*GHz", value)):
            ghz.append(float(m.group(1)))
    return max(ghz) if ghz else None


def _physical_cores(cpus: list[int], sysfs: Path) -> int:
    """Distinct (package, core) pairs among ``cpus``: SMT siblings share one core's vector units."""
    cores = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}/topology"
        try:
            cores.add((topology.joinpath("physical_package_id").read_text(), topology.joinpath("core_id").read_text()))
        except OSError:
            cores.add(cpu)
    return len(cores)


def _flops_per_cycle(flags: set[str], dtype: torch.dtype) -> int | None:
    arm = "asimd" in flags  # Arm's Features line; x86's flags never name it
    fp32 = next((f for flag, f in (_ARM_FP32 if arm else _X86_FP32) if flag in flags), None)
    sixteen = next((f for flag, f in (_ARM_16BIT if arm else _X86_16BIT).get(dtype, ()) if flag in flags), None)
    return sixteen or fp32


def cpu_peak(
    dtype: torch.dtype, threads: int | None = None, cpuinfo: str | None = None, sysfs: Path = SYSFS_CPU
) -> CpuPeak | None:
    """Peak of the cores this process computes on, in ``dtype``; None where the CPU is unknown.
    ``cpuinfo`` and ``sysfs`` stand in for /proc/cpuinfo and /sys/devices/system/cpu."""
    cpuinfo = _cpuinfo() if cpuinfo is None else cpuinfo
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    per_cycle = _flops_per_cycle(cpu_flags(cpuinfo), dtype)
    ghz = _cpu_ghz(cpuinfo, cpus, sysfs)
    if per_cycle is None or ghz is None:
        return None
    cores = min(threads or torch.get_num_threads(), _physical_cores(cpus, sysfs))
    return CpuPeak(cores, ghz, per_cycle)


def slow_compute_note(device: torch.device, dtype: torch.dtype) -> str | None:
    """One line for a run whose 16-bit matmuls take torch's generic CPU loop (no AVX-512 bf16 /
    fp16 path: an AVX2-only CPU, or ONEDNN_MAX_CPU_ISA=AVX2), about 100x slower than fp32."""
    from titanctl import _torch_compat

    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16) or _torch_compat.cpu_matmul_is_fast(dtype):
        return None
    name = "bfloat16" if dtype == torch.bfloat16 else "float16"
    return (
        f"{name} is slow on this CPU (no {name} matmul units: about 100x slower than float32); "
        "use --training.mixed_precision_param float32"
    )


def device_peak_tflops(device: torch.device, dtype: torch.dtype, configured: float = 0.0) -> float | None:
    """Peak TFLOP/s for MFU; None where no figure is known (set metrics.peak_tflops)."""
    if configured > 0:
        return configured
    if device.type == "cuda":
        return gpu_peak_tflops(torch.cuda.get_device_name(device))
    peak = cpu_peak(dtype)
    return None if peak is None else peak.tflops

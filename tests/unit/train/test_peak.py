"""The MFU peak is a property of the hardware: read from the OS, never timed, never above reach."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from titanctl import _torch_compat
from titanctl.train import peak
from titanctl.train.flops import throughput

AVX512_BF16 = "model name\t: Some Xeon @ 2.00GHz\ncpu MHz\t\t: 1800.000\nflags\t\t: fpu sse2 avx fma avx2 avx512f avx512_bf16\n"
AVX2_ONLY = "model name\t: AMD EPYC 7B13\ncpu MHz\t\t: 3000.000\nflags\t\t: fpu sse2 avx fma avx2\n"
AMX = "cpu MHz\t\t: 2500.000\nflags\t\t: avx fma avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


@pytest.fixture
def sysfs(tmp_path):
    """A /sys/devices/system/cpu without cpufreq, where this process's CPUs are SMT pairs: the
    cpuinfo text given decides the clock, and two CPUs make one core."""
    for cpu in os.sched_getaffinity(0):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{cpu // 2}\n")
    return tmp_path


def cores_of(sysfs, threads):
    return min(threads, len({cpu // 2 for cpu in os.sched_getaffinity(0)}))


@pytest.mark.parametrize("cpuinfo, dtype, ghz, per_cycle", [
    (AVX512_BF16, torch.float32, 2.0, 64),  # the model name's clock beats a lower current one
    (AVX512_BF16, torch.bfloat16, 2.0, 128),
    (AVX2_ONLY, torch.float32, 3.0, 32),
    (AVX2_ONLY, torch.bfloat16, 3.0, 32),  # no bf16 units: at most the fp32 rate
    (AMX, torch.bfloat16, 2.5, 1024),
    (AMX, torch.float16, 2.5, 64),  # AMX-BF16 does not multiply fp16
])
def test_cpu_peak_is_cores_times_clock_times_flops_per_cycle(sysfs, cpuinfo, dtype, ghz, per_cycle):
    got = peak.cpu_peak(dtype, threads=64, cpuinfo=cpuinfo, sysfs=sysfs)
    cores = cores_of(sysfs, 64)  # physical cores, not threads nor SMT siblings
    assert (got.cores, got.ghz, got.flops_per_cycle) == (cores, ghz, per_cycle)
    assert got.tflops == pytest.approx(cores * ghz * per_cycle / 1e3)
    assert peak.cpu_peak(dtype, threads=1, cpuinfo=cpuinfo, sysfs=sysfs).cores == 1


def test_cpufreqs_maximum_clock_wins(sysfs):
    for cpu in os.sched_getaffinity(0):
        (sysfs / f"cpu{cpu}" / "cpufreq").mkdir()
        (sysfs / f"cpu{cpu}" / "cpufreq" / "cpuinfo_max_freq").write_text("3700000\n")  # kHz
    assert peak.cpu_peak(torch.float32, cpuinfo=AVX2_ONLY, sysfs=sysfs).ghz == 3.7


def test_an_unknown_cpu_has_no_peak_and_so_no_mfu(sysfs):
    assert peak.cpu_peak(torch.float32, cpuinfo="flags\t: fpu\n", sysfs=sysfs) is None  # no clock, no vector units
    assert throughput(1000, 1, 1.0, 1, 1e9, None).mfu is None


def test_no_matmul_is_timed(monkeypatch):
    """Every dtype's peak comes without one multiplication (a bf16 probe alone took minutes on an
    AVX2-only EPYC)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the peak timed a matmul")

    for name in ("mm", "matmul", "bmm", "addmm"):
        monkeypatch.setattr(torch, name, refuse)
    monkeypatch.setattr(torch.Tensor, "__matmul__", refuse)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert peak.device_peak_tflops(torch.device("cpu"), dtype) > 0
    assert peak.device_peak_tflops(torch.device("cpu"), torch.bfloat16, configured=3.5) == 3.5


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_busy_machine_does_not_change_the_peak():
    idle = peak.device_peak_tflops(torch.device("cpu"), torch.float32)
    ctx = multiprocessing.get_context("spawn")
    burners = [ctx.Process(target=_spin, args=(20.0,)) for _ in range(2 * (multiprocessing.cpu_count() or 1))]
    for p in burners:
        p.start()
    try:
        time.sleep(1.0)  # every core busy
        busy = peak.device_peak_tflops(torch.device("cpu"), torch.float32)
    finally:
        for p in burners:
            p.terminate()
            p.join()
    assert busy == idle


def test_mfu_never_exceeds_100_percent():
    half = throughput(500, 1, 1.0, 1, 1e9, peak_tflops=1.0)  # 0.5 TFLOP/s
    assert half.mfu == pytest.approx(50.0)
    above = throughput(2000, 1, 1.0, 1, 1e9, peak_tflops=1.0)  # 2x what the peak allows
    assert above.tflops == pytest.approx(2.0) and above.mfu is None


def test_the_slow_16bit_note_follows_torchs_own_kernel_choice():
    cpu = torch.device("cpu")
    assert peak.slow_compute_note(cpu, torch.float32) is None
    assert peak.slow_compute_note(torch.device("meta"), torch.bfloat16) is None
    note = peak.slow_compute_note(cpu, torch.bfloat16)
    if _torch_compat.cpu_matmul_is_fast(torch.bfloat16):
        assert note is None
    else:
        assert "--training.mixed_precision_param float32" in note and "\n" not in note

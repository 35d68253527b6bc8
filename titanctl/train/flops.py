"""FLOPs per token and the per-device rates of a log window (the peak is titanctl.train.peak)."""

from __future__ import annotations

from dataclasses import dataclass

from titanctl.models.common.args import ModelArgs
from titanctl.models.registry import spec_of


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token of the whole model (the family's count, e.g. 6N + attention).

    N is the whole model's, also under TP and PP, where each device holds a part of it: the
    throughput it multiplies is per device too (tokens of the global batch / world size), and
    a device that holds 1/(tp·pp) of the model and sees 1/cp of a sequence does that share of
    the work of its data-parallel rank's tokens.
    """
    return spec_of(args).flops_per_token(args, seq_len)


@dataclass(frozen=True)
class Throughput:
    step_time: float  # seconds per optimizer step
    tps: float  # tokens per second per device
    tflops: float  # achieved TFLOP/s per device
    mfu: float | None  # % of the device's peak; None without a peak figure, or one this window exceeds


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
    # Above the peak, the peak is wrong (a clock the OS under-reports, a wrong metrics.peak_tflops):
    # such a percentage is not shown.
    mfu = 100 * tflops / peak_tflops if peak_tflops and tflops <= peak_tflops else None
    return Throughput(step_time, tps, tflops, mfu)

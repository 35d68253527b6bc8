"""torchtitan's published H100 and A100 measurements, as layouts the cost model can predict.

The GPU presets' efficiency assumptions cannot be measured without a GPU; these are the evidence
they are checked against. Sources, torchtitan's docs/performance.md:
- ``MEASUREMENTS``, its December 2024 version (the TorchTitan paper's benchmarks): Llama 3.1 8B,
  70B and 405B on "Grand Teton" hosts of 8 H100 (96 GB HBM2e at 2.4 TB/s, 500 W power limit, NVLink
  within a host, 400 Gb/s RDMA per GPU), tokens per second per GPU read at iteration 90. The
  pipelines of that torchtitan split each local batch into as many microbatches as the pipeline
  degree (its default then), so they are written that way here.
- ``A100_MEASUREMENTS``, its earlier version: Llama 3 8B and 70B with FSDP alone on 64 A100 80GB
  (local batch 1, eager, bf16), no memory figures.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from titanctl.planning.plan.candidates import Candidate
from titanctl.planning.plan.devices import PRESETS, Device
from titanctl.planning.plan.search import Layout, Planner, recipe_config

REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Measurement:
    table: str  # where it is published
    recipe: str  # recipes/llama3_*.toml (the same model; the recipe's dtypes and settings)
    seq_len: int
    global_batch: int  # sequences per step
    layout: Candidate
    tokens_per_second_per_gpu: float
    memory_gib: float | None  # the most any GPU's caching allocator reserved (allocated + its slack)


def _c(dp_shard: int, tp: int, pp: int, cp: int, local_batch: int, *, ac: str, compile: bool = True,
       float8: bool = True, async_tp: bool = False, schedule: str = "", microbatch: int = 1) -> Candidate:
    return Candidate(1, dp_shard, tp, pp, cp, 1, local_batch, 1, pp_schedule=schedule, pp_microbatch_size=microbatch,
                     ac=ac, compile=compile, float8=float8, async_tp=async_tp)


_8B, _70B, _405B = "recipes/llama3_8b.toml", "recipes/llama3_70b.toml", "recipes/llama3_405b.toml"
_OP = "selective_op"
_3D = {"ac": "full", "async_tp": True, "schedule": "1F1B"}
MEASUREMENTS: tuple[Measurement, ...] = (
    Measurement("1: FSDP", _8B, 8192, 16, _c(8, 1, 1, 1, 2, ac=_OP, compile=False, float8=False), 5762, 82.4),
    Measurement("1: FSDP + compile", _8B, 8192, 16, _c(8, 1, 1, 1, 2, ac=_OP, float8=False), 6667, 77.0),
    Measurement("1: FSDP + compile + Float8", _8B, 8192, 16, _c(8, 1, 1, 1, 2, ac=_OP), 8532, 76.8),
    Measurement("3: FSDP", _8B, 8192, 256, _c(128, 1, 1, 1, 2, ac=_OP, compile=False, float8=False), 5605, 67.0),
    Measurement("3: FSDP + compile", _8B, 8192, 256, _c(128, 1, 1, 1, 2, ac=_OP, float8=False), 6514, 62.0),
    Measurement("3: FSDP + compile + Float8", _8B, 8192, 256, _c(128, 1, 1, 1, 2, ac=_OP), 8380, 61.8),
    Measurement("2: FSDP 8, CP 1", _8B, 32768, 8, _c(8, 1, 1, 1, 1, ac="full"), 3890, 83.9),
    Measurement("2: FSDP 4, CP 2", _8B, 65536, 4, _c(4, 1, 1, 2, 1, ac="full"), 2540, 84.2),
    Measurement("2: FSDP 2, CP 4", _8B, 131072, 2, _c(2, 1, 1, 4, 1, ac="full"), 1071, 84.0),
    Measurement("2: FSDP 1, CP 8", _8B, 262144, 1, _c(1, 1, 1, 8, 1, ac="full"), 548, 84.5),
    Measurement("4: 2D", _70B, 8192, 512, _c(32, 8, 1, 1, 16, ac="full"), 829, 71.9),
    Measurement("4: 2D + AsyncTP", _70B, 8192, 512, _c(32, 8, 1, 1, 16, ac="full", async_tp=True), 876, 67.6),
    Measurement("5: 1F1B", _405B, 8192, 256, _c(8, 8, 8, 1, 32, **_3D, microbatch=4), 100, 82.5),
    Measurement("5: Interleaved 1F1B", _405B, 8192, 256,
                _c(8, 8, 8, 1, 32, **{**_3D, "schedule": "Interleaved1F1B"}, microbatch=4), 128, 72.7),
    Measurement("6: FSDP 8, CP 1", _405B, 32768, 64, _c(8, 8, 8, 1, 8, **_3D), 76, 75.3),
    Measurement("6: FSDP 4, CP 2", _405B, 65536, 32, _c(4, 8, 8, 2, 8, **_3D), 47, 75.9),
    Measurement("6: FSDP 2, CP 4", _405B, 131072, 16, _c(2, 8, 8, 4, 8, **_3D), 31, 77.1),
    Measurement("6: FSDP 1, CP 8", _405B, 262144, 8, _c(1, 8, 8, 8, 8, **_3D), 16, 84.9),
)

_EAGER = {"compile": False, "float8": False}
A100_MEASUREMENTS: tuple[Measurement, ...] = (
    Measurement("8B, selective layer", _8B, 8192, 64, _c(64, 1, 1, 1, 1, ac="selective_2", **_EAGER), 2904, None),
    Measurement("8B, selective op", _8B, 8192, 64, _c(64, 1, 1, 1, 1, ac=_OP, **_EAGER), 2973, None),
    Measurement("70B, full", _70B, 8192, 64, _c(64, 1, 1, 1, 1, ac="full", **_EAGER), 331, None),
)

# Ratios of two measurements (numerator table, denominator table): what one technique buys.
GAINS = {
    "torch.compile (8B, 8 GPUs)": ("1: FSDP + compile", "1: FSDP"),
    "Float8 (8B, 8 GPUs)": ("1: FSDP + compile + Float8", "1: FSDP + compile"),
    "8 -> 128 GPUs (8B, compile + Float8)": ("3: FSDP + compile + Float8", "1: FSDP + compile + Float8"),
    "async TP (70B, 256 GPUs)": ("4: 2D + AsyncTP", "4: 2D"),
    "Interleaved 1F1B over 1F1B (405B, 512 GPUs)": ("5: Interleaved 1F1B", "5: 1F1B"),
}


def grand_teton(base: Device = PRESETS["h100"]) -> Device:
    """The H100 of the measurements: the preset with its memory (96 GB HBM2e at 2.4 TB/s); its 500 W
    clocks are not a published figure, so the peak stays the datasheet's."""
    return dataclasses.replace(base, name="h100 (Grand Teton)", memory_gib=96.0, memory_bandwidth_gbps=2400.0)


def measurement_config(m: Measurement):
    """The recipe's JobConfig at the measurement's sequence length."""
    cfg = recipe_config(REPO / m.recipe)
    return dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, seq_len=m.seq_len))


@dataclass(frozen=True)
class Prediction:
    measurement: Measurement
    layout: Layout  # the cost model's step and the fast memory path's peak

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.layout.tokens_per_second_per_device

    @property
    def memory_gib(self) -> float:
        """The fast memory path's peak (the busiest rank, allocated: no allocator slack)."""
        return self.layout.fast_memory / 2**30


def predict(device: Device, measurements: tuple[Measurement, ...] = MEASUREMENTS) -> list[Prediction]:
    """The cost model's and the fast memory path's figures for each published measurement on ``device``."""
    planners: dict[tuple[str, int], Planner] = {}
    out = []
    for m in measurements:
        key = (m.recipe, m.seq_len)
        if key not in planners:
            planners[key] = Planner(m.recipe, measurement_config(m), device)
        out.append(Prediction(m, planners[key].evaluate(m.layout, m.global_batch)))
    return out


def gains(predictions: list[Prediction]) -> dict[str, tuple[float, float]]:
    """name -> (published ratio, predicted ratio) for each entry of GAINS."""
    by_table = {p.measurement.table: (p.measurement.tokens_per_second_per_gpu, p.tokens_per_second_per_gpu)
                for p in predictions}
    return {name: (by_table[a][0] / by_table[b][0], by_table[a][1] / by_table[b][1])
            for name, (a, b) in GAINS.items()}

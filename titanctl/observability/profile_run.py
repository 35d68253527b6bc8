"""``titanctl profile``: train a few steps with the last one recorded, then say where its time went,
per rank and across ranks (``trace_analysis``'s rules), from the traces ``titanctl.train.step_profiler``
wrote.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from titanctl.config.job_config import JobConfig
from titanctl.errors import ProfilingError
from titanctl.observability.trace_analysis import analyze_profiles, read_document
from titanctl.parallel.runtime.env import device_type
from titanctl.safe_io import load_json
from titanctl.train.step_profiler import MEMORY_TIMELINE_FILE, TRACE_FILE, check_profiling, iteration_folder
from titanctl.train.trainer import Trainer


@dataclass
class OpRow:
    name: str
    communication: bool
    self_us: dict[int, float]  # rank -> self time (0 when the op did not run there)
    calls: dict[int, int]

    @property
    def mean_self_us(self) -> float:
        return sum(self.self_us.values()) / max(1, len(self.self_us))


@dataclass
class ProfileSummary:
    step: int
    folder: Path
    report: object  # titanctl.observability.trace_analysis.ProfileReport
    top_ops: list[OpRow]
    peak_memory_bytes: dict[int, dict[str, int]]  # rank -> device -> peak allocated bytes
    traces: list[Path]

    @property
    def ranks(self) -> list[int]:
        return [p.rank for p in self.report.ranks]


def latest_iteration(traces_folder: Path) -> int:
    steps = [int(p.name.split("_", 1)[1]) for p in Path(traces_folder).glob("iteration_*")
             if p.name.split("_", 1)[1].isdigit()]
    if not steps:
        raise ProfilingError(f"no profiler traces were written under {traces_folder}")
    return max(steps)


def run(cfg: JobConfig, steps: int, top: int = 15) -> ProfileSummary | None:
    """Train ``steps`` steps of ``cfg`` with the last one recorded and checkpointing off (neither
    resumed from nor written), then summarize every rank's trace of it. Returns the summary on
    rank 0, None on the other ranks (which only take part in training)."""
    cfg = copy.deepcopy(cfg)
    cfg.training.steps = steps
    cfg.profiling.enable_profiling = True
    cfg.profiling.profile_freq = steps  # one recorded step: the last
    cfg.checkpoint.enable_checkpoint = False
    cfg.checkpoint.create_seed_checkpoint = False  # a seed run writes a checkpoint and stops: no step to profile
    cfg.validation.enabled = False  # an evaluation at the recorded step would be timed as part of it
    check_profiling(cfg.profiling, device_type())
    trainer = Trainer(cfg)
    trainer.train()
    if dist.is_initialized():
        dist.barrier()  # every rank's trace is on disk
    if trainer.env.rank != 0:
        return None
    return summarize(Path(cfg.job.dump_folder) / cfg.profiling.save_traces_folder, step=steps, top=top)


def summarize(traces_folder: Path, step: int | None = None, top: int = 15) -> ProfileSummary:
    """Where the time of one recorded step went, on every rank (trace_analysis's rules)."""
    step = latest_iteration(traces_folder) if step is None else step
    folder = iteration_folder(traces_folder, step)
    traces = sorted(folder.glob(TRACE_FILE.format(rank="*")))
    if not traces:
        raise ProfilingError(f"no rank*_trace.json files in {folder}")
    report = analyze_profiles([(p, read_document(p)) for p in traces], top=10**9)
    rows: dict[str, OpRow] = {}
    for rank in report.ranks:
        for op in rank.top_ops:
            row = rows.setdefault(op.name, OpRow(op.name, op.communication, {}, {}))
            row.self_us[rank.rank], row.calls[rank.rank] = op.self_us, op.calls
    for row in rows.values():
        for rank in report.ranks:
            row.self_us.setdefault(rank.rank, 0.0)
            row.calls.setdefault(rank.rank, 0)
    top_ops = sorted(rows.values(), key=lambda r: (-r.mean_self_us, r.name))[:top]
    for rank in report.ranks:  # the cross-rank table replaces the per-rank lists
        rank.top_ops = []
    peaks: dict[int, dict[str, int]] = {}
    for rank in report.ranks:
        path = folder / MEMORY_TIMELINE_FILE.format(rank=rank.rank)
        if path.is_file():
            timeline = load_json(path, what="memory timeline", error=ProfilingError)
            devices = timeline.get("devices") if isinstance(timeline, dict) else None
            peaks[rank.rank] = {
                d: v["peak_allocated_bytes"] for d, v in (devices if isinstance(devices, dict) else {}).items()
                if isinstance(v, dict) and isinstance(v.get("peak_allocated_bytes"), int)
            }
    return ProfileSummary(step, folder, report, top_ops, peaks, traces)

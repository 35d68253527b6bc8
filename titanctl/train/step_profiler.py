"""Runtime profiling of training steps: torch.profiler traces, memory timelines, CUDA memory snapshots.

The training loop wraps itself in :func:`maybe_profile` and calls ``profiler.step()`` after each
step. Every ``profiling.profile_freq`` steps (steps N, 2N, ...) one step is recorded, after a
warmup of up to 3 steps. Per rank and recorded step it writes::

    {dump_folder}/{profiling.save_traces_folder}/iteration_{step}/rank{r}_trace.json
        Chrome/Perfetto trace (open in ui.perfetto.dev; `titanctl inspect-trace` and
        ``titanctl.observability.profile_run.summarize`` read it)
    {dump_folder}/{profiling.save_traces_folder}/iteration_{step}/rank{r}_memory_timeline.json
        allocated bytes over the step, from the profiler's memory events, per device
    {dump_folder}/{profiling.save_memory_snapshot_folder}/iteration_{step}/rank{r}_memory_snapshot.pickle
        CUDA only, with profiling.enable_memory_snapshot (drag into pytorch.org/memory_viz)

On CPU the memory timeline counts the bytes of tensors allocated while the profiler was on (net of
frees); CPU tensors allocated before profiling started (e.g. the weights) are not in it. On CUDA the
profiler reports the caching allocator's totals.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from titanctl import _torch_compat
from titanctl.config.job_config import JobConfig, Profiling
from titanctl.errors import ProfilingError
from titanctl.parallel.runtime.env import device_type
from titanctl.safe_io import replace_atomically

TRACE_FILE = "rank{rank}_trace.json"  # trace_analysis reads the rank from "rank{r}" in the name
MEMORY_TIMELINE_FILE = "rank{rank}_memory_timeline.json"
SNAPSHOT_FILE = "rank{rank}_memory_snapshot.pickle"
MAX_WARMUP_STEPS = 3
SNAPSHOT_MAX_ENTRIES = 100_000
_DEVICE_NAMES = {0: "cpu", 1: "cuda"}  # the profiler's "Device Type" codes
# kineto (torch 2.13) writes "USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start"
# (and _stop) to stderr at every start and stop. They are tracing probes' markers, at a severity
# above ERROR: KINETO_LOG_LEVEL could only hide them by hiding kineto's errors too.
_KINETO_MARKER = re.compile(rb"^USDT:.*\] profiler_(start|stop)\s*$")


@contextlib.contextmanager
def without_kineto_markers() -> Iterator[None]:
    """Drop kineto's profiler_start/profiler_stop lines from stderr (fd 2) while the block runs;
    every other line written meanwhile (warnings, errors, from C++ or Python) is passed on after it."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured:
                if not _KINETO_MARKER.match(line):
                    os.write(2, line)



def check_profiling(cfg: Profiling, device_type: str) -> None:
    """Refuse options that need hardware this run does not have, before any work."""
    if cfg.enable_memory_snapshot and device_type != "cuda":
        raise ProfilingError(
            f"profiling.enable_memory_snapshot needs CUDA (torch.cuda memory snapshots); this run is on "
            f"{device_type}: set it to false (the profiler's rank{{r}}_memory_timeline.json covers CPU memory)"
        )


def schedule_for(profile_freq: int) -> tuple[int, int, int]:
    """(wait, warmup, active): record 1 step in every ``profile_freq``, the last one of each cycle."""
    warmup = min(MAX_WARMUP_STEPS, profile_freq - 1)
    return profile_freq - 1 - warmup, warmup, 1


def iteration_folder(base: Path, step: int) -> Path:
    return Path(base) / f"iteration_{step}"


class _NoProfiler:
    written: tuple = ()

    def step(self) -> None:
        pass


@dataclass
class StepProfiler:
    """Drives torch.profiler and the CUDA memory history over training steps (see the module doc)."""

    cfg: Profiling
    rank: int
    dump_folder: Path
    device_type: str
    step_num: int = 0  # the training step last completed
    log: Callable[[str], None] | None = None
    written: list[Path] = field(default_factory=list)
    _torch_prof: object = None

    @property
    def traces_folder(self) -> Path:
        return self.dump_folder / self.cfg.save_traces_folder

    @property
    def snapshot_folder(self) -> Path:
        return self.dump_folder / self.cfg.save_memory_snapshot_folder

    def start(self) -> None:
        if self.cfg.enable_memory_snapshot:
            _torch_compat.RECORD_MEMORY_HISTORY.get()(max_entries=SNAPSHOT_MAX_ENTRIES)
        if self.cfg.enable_profiling:
            # Each cycle is written out at its end; keeping events across cycles is not wanted.
            warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle")
            activities = [ProfilerActivity.CPU]
            if self.device_type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            wait, warmup, active = schedule_for(self.cfg.profile_freq)
            cycle = schedule(wait=wait, warmup=warmup, active=active)
            offset = self.step_num  # a resumed run keeps recording steps N, 2N, ...
            self._torch_prof = profile(
                activities=activities,
                schedule=lambda n: cycle(n + offset),
                on_trace_ready=self._trace_ready,
                record_shapes=True,
                profile_memory=True,
                with_stack=False,
            )
            with without_kineto_markers():
                self._torch_prof.__enter__()

    def step(self) -> None:
        """Call after every training step."""
        self.step_num += 1
        if self._torch_prof is not None:
            with without_kineto_markers():
                self._torch_prof.step()  # writes the trace when the recorded step just ended
        if self.cfg.enable_memory_snapshot and self.step_num % self.cfg.profile_freq == 0:
            self._dump_snapshot(iteration_folder(self.snapshot_folder, self.step_num))

    def stop(self, exc: BaseException | None = None) -> None:
        if self._torch_prof is not None:
            # Completed recorded steps were written by step(); one still open at exit never ran.
            self._torch_prof.on_trace_ready = None
            with without_kineto_markers():
                self._torch_prof.__exit__(None, None, None)
            self._torch_prof = None
        if self.cfg.enable_memory_snapshot:
            if isinstance(exc, torch.OutOfMemoryError):  # the snapshot that explains the OOM
                self._dump_snapshot(self.snapshot_folder / f"iteration_{self.step_num + 1}_oom")
            _torch_compat.RECORD_MEMORY_HISTORY.get()(enabled=None)

    def _trace_ready(self, prof) -> None:
        folder = iteration_folder(self.traces_folder, self.step_num)
        folder.mkdir(parents=True, exist_ok=True)
        trace = folder / TRACE_FILE.format(rank=self.rank)
        prof.export_chrome_trace(str(trace))
        timeline = folder / MEMORY_TIMELINE_FILE.format(rank=self.rank)
        _write_json(timeline, memory_timeline(json.loads(trace.read_text()), self.rank, self.step_num))
        self.written += [trace, timeline]
        if self.log is not None:
            self.log(f"profiler: step {self.step_num} trace and memory timeline in {folder}")

    def _dump_snapshot(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / SNAPSHOT_FILE.format(rank=self.rank)
        _torch_compat.DUMP_MEMORY_SNAPSHOT.get()(str(path))
        self.written.append(path)
        if self.log is not None:
            self.log(f"profiler: CUDA memory snapshot in {path}")


@contextlib.contextmanager
def maybe_profile(
    cfg: JobConfig,
    rank: int,
    dump_folder: Path,
    *,
    start_step: int = 0,
    log: Callable[[str], None] | None = None,
) -> Iterator[StepProfiler | _NoProfiler]:
    """``with maybe_profile(cfg, rank, dump_folder) as prof:`` ... ``prof.step()`` after each step.

    A no-op unless ``profiling.enable_profiling`` or ``profiling.enable_memory_snapshot`` is on.
    ``start_step`` is the step a resumed run starts after, so recorded steps stay N, 2N, ...
    """
    p = cfg.profiling
    if not (p.enable_profiling or p.enable_memory_snapshot):
        yield _NoProfiler()
        return

    check_profiling(p, device_type())
    prof = StepProfiler(p, rank, Path(dump_folder), device_type(), step_num=start_step, log=log)
    prof.start()
    try:
        yield prof
    except BaseException as e:
        prof.stop(e)
        raise
    prof.stop()


def _write_json(path: Path, data) -> None:
    replace_atomically(path, json.dumps(data).encode(), what="profiler output")


# ------------------------------------------------------------------------------ memory timeline


def memory_timeline(trace: dict, rank: int, step: int) -> dict:
    """The ``[memory]`` events of a Chrome trace (profile_memory=True) as a timeline per device.

    Times are the trace's microsecond timestamps, so they line up with its operators.
    """
    points: dict[str, list[tuple[float, int, int]]] = {}
    for e in trace.get("traceEvents", ()):
        if e.get("name") != "[memory]" or not isinstance(e.get("args"), dict):
            continue
        a = e["args"]
        device = _DEVICE_NAMES.get(a.get("Device Type"), f"device_type_{a.get('Device Type')}")
        if a.get("Device Id", -1) >= 0 and device != "cpu":
            device = f"{device}:{a['Device Id']}"
        points.setdefault(device, []).append(
            (float(e["ts"]), int(a.get("Total Allocated", 0)), int(a.get("Total Reserved", 0)))
        )
    devices = {}
    for device, pts in points.items():
        pts.sort(key=lambda p: p[0])
        peak = max(range(len(pts)), key=lambda i: pts[i][1])
        devices[device] = {
            "times_us": [p[0] for p in pts],
            "allocated_bytes": [p[1] for p in pts],
            "reserved_bytes": [p[2] for p in pts],
            "peak_allocated_bytes": pts[peak][1],
            "peak_at_us": pts[peak][0],
            "events": len(pts),
        }
    return {
        "format": "titanctl-memory-timeline",
        "version": 1,
        "rank": rank,
        "step": step,
        "source": "torch.profiler profile_memory events",
        "note": "CPU: bytes of tensors allocated while profiling (net of frees), not the whole process",
        "devices": devices,
    }

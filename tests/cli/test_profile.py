"""`titanctl profile` as a user runs it (alone and under torchrun), and the profiler schedule
that `titanctl train` uses (in process)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.cli_server import titanctl_run
from tests.conftest import OFFLINE_ENV, REPO
from tests.distributed.harness import torchrun
from titanctl.config.job_config import JobConfig
from titanctl.errors import ProfilingError
from titanctl.train.step_profiler import maybe_profile, schedule_for

TINY = ["--steps", "3", "--model.n_layers", "2", "--training.seq_len", "64", "--training.local_batch_size", "4"]
# The linears' products: torch's (MKL), or oneDNN's where training.cpu_linear (default "auto") picks it.
MATMULS = {"aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"}


def run(args, check=True):
    env = {**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": "1"}
    proc = titanctl_run([*args], env=env, timeout=600, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    proc = run(["profile", "--config", str(REPO / "recipes/llama3_debug.toml"), *TINY, "--job.dump_folder", str(out)])
    return out / "profile_trace" / "iteration_3", proc


def test_trace_and_memory_timeline_are_written(single):
    folder, _ = single
    assert sorted(p.name for p in folder.iterdir()) == ["rank0_memory_timeline.json", "rank0_trace.json"]
    trace = json.loads((folder / "rank0_trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert names & MATMULS
    assert [n for n in names if str(n).startswith("ProfilerStep#")] == ["ProfilerStep#2"]  # one step recorded
    timeline = json.loads((folder / "rank0_memory_timeline.json").read_text())
    cpu = timeline["devices"]["cpu"]
    assert timeline["rank"] == 0 and timeline["step"] == 3
    assert len(cpu["times_us"]) == len(cpu["allocated_bytes"]) == cpu["events"] > 0
    assert cpu["peak_allocated_bytes"] == max(cpu["allocated_bytes"]) > 0


def test_kineto_start_stop_markers_are_not_shown(single):
    _, proc = single
    assert "USDT" not in proc.stderr and "profiler_start" not in proc.stderr, proc.stderr


def test_marker_filter_keeps_every_other_stderr_line(capfd):
    import sys

    from titanctl.train.step_profiler import without_kineto_markers

    with without_kineto_markers():
        os.write(2, b"USDT:2026-11-24 04:51:58 15753:15753 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"ERROR:2026-11-24 04:51:58 15753:15753 Something.cpp:1] a real kineto error\n")
        print("a Python warning", file=sys.stderr)
        os.write(2, b"USDT:2026-11-24 04:51:58 15753:15753 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
    lines = capfd.readouterr().err.splitlines()  # (pytest routes sys.stderr apart from fd 2: order differs)
    assert sorted(lines) == ["ERROR:2026-11-24 04:51:58 15753:15753 Something.cpp:1] a real kineto error",
                             "a Python warning"]


def test_summary_says_where_the_time_went(single):
    folder, proc = single
    out = proc.stdout
    assert "Where the time went" in out and any(op in out for op in MATMULS)
    assert "compute" in out and "communication" in out
    assert f"titanctl inspect-trace {folder}" in out


def test_inspect_trace_reads_the_profile_folder(single):
    from titanctl.observability.trace_analysis import inspect_path

    folder, _ = single
    result = inspect_path(folder)
    assert [r.rank for r in result.profile.ranks] == [0] and result.profile.ranks[0].steps == 1
    assert result.skipped == [str(folder / "rank0_memory_timeline.json")]


def test_two_ranks_under_torchrun(tmp_path):
    proc = torchrun(2, ["-m", "titanctl", "profile"],
                    ["--config", str(REPO / "recipes/llama3_debug.toml"), *TINY, "--job.dump_folder", str(tmp_path)])
    folder = tmp_path / "profile_trace" / "iteration_3"
    for rank in (0, 1):
        trace = json.loads((folder / f"rank{rank}_trace.json").read_text())
        assert trace["distributedInfo"]["rank"] == rank
        assert (folder / f"rank{rank}_memory_timeline.json").is_file()
    out = proc.stdout
    assert "2 rank(s)" in out and "rank 0" in out and "rank 1" in out  # a column per rank
    assert "straggler" in out  # the cross-rank verdict
    assert "gloo:" in out  # FSDP's collectives show up as communication


def test_memory_snapshot_on_cpu_is_a_clear_error(capsys, monkeypatch):
    """In this process (fast): refused before the trainer is built."""
    from titanctl.cli.app import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, on any machine
    with pytest.raises(SystemExit) as exc:
        main(["profile", *TINY, "--profiling.enable_memory_snapshot"])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "profiling.enable_memory_snapshot needs CUDA" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------ the schedule, in process


@pytest.mark.parametrize("freq, expected", [(1, (0, 0, 1)), (2, (0, 1, 1)), (4, (0, 3, 1)), (10, (6, 3, 1))])
def test_schedule_records_the_last_step_of_each_cycle(freq, expected):
    assert schedule_for(freq) == expected


@pytest.mark.parametrize("start_step, steps, expected", [(0, 5, [2, 4]), (3, 4, [4, 6])])
def test_training_loop_records_every_profile_freq_steps(tmp_path, start_step, steps, expected):
    cfg = JobConfig()
    cfg.profiling.enable_profiling = True
    cfg.profiling.profile_freq = 2
    a = torch.randn(32, 32)
    with maybe_profile(cfg, 0, tmp_path, start_step=start_step) as prof:
        for _ in range(steps):
            (a @ a).sum()
            prof.step()
    folders = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "profile_trace").iterdir())
    assert folders == expected
    assert len(prof.written) == 2 * len(expected)


def test_disabled_profiling_is_a_no_op(tmp_path):
    with maybe_profile(JobConfig(), 0, tmp_path) as prof:
        prof.step()
    assert not list(tmp_path.iterdir())


def test_memory_snapshot_needs_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, on any machine
    cfg = JobConfig()
    cfg.profiling.enable_memory_snapshot = True
    with pytest.raises(ProfilingError, match="needs CUDA"):
        with maybe_profile(cfg, 0, tmp_path):
            pass

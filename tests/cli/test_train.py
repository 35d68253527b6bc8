"""`titanctl train` run as a user runs it: a subprocess, offline."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.cli_server import titanctl_run
from tests.conftest import OFFLINE_ENV
from titanctl.train.peak import cpu_peak

TINY = ["--model.n_layers", "2", "--training.seq_len", "64", "--training.local_batch_size", "4"]


def run(args, tmp_path=None, check=True, env=None):
    env = {**os.environ, **OFFLINE_ENV, **(env or {})}
    proc = titanctl_run([*args], env=env, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def rows(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def debug_run(tmp_path_factory, repo):
    """10 steps of the debug recipe (as the README's tour and docs/training.md's first example run it), in 2 of
    its 6 layers: the tour's shapes, so its compiled kernels and the tour's (tests/unit/test_docs_runnable.py)
    are one set in inductor's cache, in 40% of the 6 layers' step time."""
    out = tmp_path_factory.mktemp("debug_run")
    proc = run(["train", "--config", str(repo / "recipes/llama3_debug.toml"), "--training.steps", "10",
                "--model.n_layers", "2", "--job.dump_folder", str(out)])
    return out, proc


def documented_metric_keys(repo) -> set[str]:
    """The keys of docs/training.md's metrics.jsonl table that a CPU run logs (CUDA-only rows left out)."""
    lines = (repo / "docs" / "training.md").read_text().split("| key | meaning |\n| --- | --- |\n", 1)[1].splitlines()
    keys = set()
    for line in lines:
        if not line.startswith("|"):
            break
        names, meaning = line.split("|")[1:3]
        if not meaning.strip().startswith("CUDA only"):
            keys.update(name.strip(" `") for name in names.split(","))
    return keys


def test_debug_recipe_writes_a_metric_row_per_step(debug_run, repo):
    out, proc = debug_run
    data = rows(out)
    assert [r["step"] for r in data] == list(range(1, 11))
    documented = documented_metric_keys(repo)
    assert {"tps", "tflops", "mfu", "step_time", "memory_gib", "tokens_seen"} <= documented
    for r in data:
        assert set(r) == {"step"} | documented
        assert r["memory_gib"] > 0
    # The recipe compiles: step 1 (compile + warm-up) is timed apart, without rates, and said so.
    assert data[0]["tps"] is data[0]["tflops"] is data[0]["mfu"] is None and data[0]["step_time"] > 0
    assert "first step" in proc.stdout and "torch.compile and warm-up; not counted in tps" in proc.stdout
    # MFU divides by the hardware's fp32 peak (cores x clock x FLOPs per cycle; the recipe is fp32),
    # the same in every row, and is never above 100%: a window faster than that peak (a clock the
    # OS under-reports) shows no MFU and says why.
    hardware = cpu_peak(torch.float32, threads=os.cpu_count()).tflops
    for r in data[1:]:
        assert r["tps"] > 0 and r["tflops"] > 0
        if r["mfu"] is None:
            assert r["tflops"] > hardware and "mfu not shown" in proc.stdout
        else:
            assert 0 < r["mfu"] <= 100 and r["mfu"] == pytest.approx(100 * r["tflops"] / hardware, rel=2e-3)
    assert data[-1]["loss"] < data[0]["loss"] - 0.5, [r["loss"] for r in data]
    assert "step     10" in proc.stdout


def test_tensorboard_events_are_readable(debug_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = debug_run
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    losses = acc.Scalars("train/loss")
    assert [e.step for e in losses] == list(range(1, 11))
    assert losses[0].value == pytest.approx(rows(out)[0]["loss"], rel=1e-6)
    # Every number of a metrics.jsonl row is a train/<key> scalar at its step, throughput included.
    logged = set(acc.Tags()["scalars"])
    assert {"train/tps", "train/tflops", "train/mfu", "train/step_time"} <= logged
    for key in ("tps", "tflops", "mfu"):
        events = acc.Scalars(f"train/{key}")
        assert [e.step for e in events] == list(range(2, 11))  # step 1 has no rates (compile, warm-up)
        for event, row in zip(events, rows(out)[1:]):
            assert row[key] > 0 and event.value == pytest.approx(row[key], rel=1e-6), (key, row)
    numbers = {f"train/{k}" for k, v in rows(out)[1].items() if k != "step" and isinstance(v, (int, float))}
    assert logged == numbers


def test_same_seed_same_losses_and_other_seed_differs(tmp_path):
    base = ["train", *TINY, "--training.steps", "3", "--training.deterministic"]
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        run([*base, "--training.seed", str(seed), "--job.dump_folder", str(tmp_path / name)])
    a, b, c = ([r["loss"] for r in rows(tmp_path / n)] for n in "abc")
    assert a == b
    assert a != c


# torch's and oneDNN's AVX2 code paths on any x86 CPU: bf16 matmuls then take torch's generic loop,
# as on an AVX2-only EPYC (no bf16 units), where a bf16 matmul probe for the MFU peak ran for minutes.
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
SLOW_BF16 = "bfloat16 is slow on this CPU"


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_a_default_precision_run_starts_at_once_and_times_no_matmul(tmp_path, isa):
    """One bf16 step (the default precision) on a fresh cache: no probe runs, no peak is cached,
    and where bf16 takes torch's slow path the run says so once, with the way out."""
    from titanctl import _torch_compat

    cache = tmp_path / "cache"
    cache.mkdir()
    env = {"TITANCTL_CACHE_DIR": str(cache), **(AVX2_ONLY if isa == "avx2" else {})}
    start = time.monotonic()
    proc = run(["train", "--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
                "--training.steps", "1", "--job.dump_folder", str(tmp_path / "out")], env=env)
    assert time.monotonic() - start < 120  # the probe alone took over 600 s on an AVX2-only CPU
    assert {p.name for p in cache.iterdir()} <= {"tokens"}  # the tokenized corpus, no peak figure
    slow = isa == "avx2" or not _torch_compat.cpu_matmul_is_fast(torch.bfloat16)
    assert proc.stdout.count(SLOW_BF16) == (1 if slow else 0), proc.stdout
    if slow:
        line = next(line for line in proc.stdout.splitlines() if SLOW_BF16 in line)
        assert "--training.mixed_precision_param float32" in line
    assert rows(tmp_path / "out")[0]["step"] == 1


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    # fp32, DESIGN.md's 1e-5: in bf16 the two sums round apart by more on CPUs without bf16 units.
    big = ["train", *TINY[:4], "--training.steps", "3", "--training.mixed_precision_param", "float32",
           "--training.local_batch_size", "4"]
    run([*big, "--job.dump_folder", str(tmp_path / "big")])
    run([*big[:-1], "2", "--training.global_batch_size", "4", "--job.dump_folder", str(tmp_path / "acc")])
    big_losses = [r["loss"] for r in rows(tmp_path / "big")]
    acc_losses = [r["loss"] for r in rows(tmp_path / "acc")]
    assert acc_losses == pytest.approx(big_losses, rel=1e-5)


def test_diverging_loss_stops_with_a_clear_message(tmp_path):
    proc = run(["train", *TINY, "--training.steps", "5", "--optimizer.lr", "1e12", "--training.max_norm", "0",
                "--lr_scheduler.warmup_steps", "0", "--job.dump_folder", str(tmp_path)], check=False)
    assert proc.returncode == 2
    assert "loss is nan" in proc.stderr or "loss is inf" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--training.stepz", "3"], "did you mean 'training.steps'?"),
        (["train", "--config", "missing.toml"], "config file not found: missing.toml"),
        (["train", "--training.dataset", "c5"], "c5"),
        (["train", "--training.dataset_path", "/no/such/file.jsonl"], "/no/such/file.jsonl"),
        (["train", "--model.tokenizer_path", "/no/such/tokenizer.model"], "/no/such/tokenizer.model"),
        (["train", "--parallelism.tensor_parallel_degree", "3"], "world size 1 is not divisible"),
    ],
)
def test_bad_input_is_one_red_line_and_exit_2(args, message):
    proc = run(args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_debug_flag_shows_the_traceback():
    proc = run(["--debug", "train", "--training.stepz", "3"], check=False)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_print_config_is_toml_with_overrides(repo):
    import tomllib

    proc = run(["train", "--config", str(repo / "recipes/llama3_8b.toml"), "--training.steps", "7", "--print-config"])
    cfg = tomllib.loads(proc.stdout)
    assert cfg["training"]["steps"] == 7 and cfg["model"]["flavor"] == "8B"


def test_help_lists_every_subcommand_without_importing_torch():
    probe = "import sys, titanctl.cli.app; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "False"
    out = run(["--help"]).stdout
    for command in ("train", "download-tokenizer", "convert-checkpoint", "convert", "estimate-memory",
                    "profile", "inspect-trace", "infer-tp"):
        assert command in out

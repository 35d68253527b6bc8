"""Values that can never finish are refused up front, in one line naming the bound, within seconds
(estimate-memory with 10^5 layers ran past 300 s; a missing schedule file or a split point past the
last layer was ignored, and the run trained on)."""

from __future__ import annotations

import os
import time

import pytest

from tests.cli_server import titanctl_run
from tests.conftest import OFFLINE_ENV

QUICK_S = 60  # each case answers in a few seconds; what it replaces ran for minutes or forever


def refused(*args, cwd=None) -> str:
    env = {**os.environ, **OFFLINE_ENV}
    start = time.monotonic()
    proc = titanctl_run([*args], env=env, timeout=300, cwd=cwd)
    assert time.monotonic() - start < QUICK_S
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc.stderr


def test_steps_that_never_end_in_a_recipe(tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text("[training]\nsteps = 100000000000000000000000000\n")
    assert "'training.steps'" in refused("train", "--config", str(recipe), "--job.dump_folder", str(tmp_path / "o"))
    recipe.write_text("[training]\nsteps = 1000000000000\n")  # fits 64 bits, still never ends
    assert "must be in [1, 1000000000]" in refused("train", "--config", str(recipe))
    assert not (tmp_path / "o").exists()


def test_profile_steps_are_bounded():
    assert "--steps" in refused("profile", "--steps", str(10**21))


def test_estimate_memory_refuses_absurd_depth():
    assert "'model.n_layers' = 100000 must be in [0, 1024]" in refused(
        "estimate-memory", "--world-size", "1", "--model.n_layers", "100000")


def test_generation_past_the_models_context(trained_run, tmp_path):
    """The trained model's context is its 64-token sequence length."""
    err = refused("infer-tp", "--checkpoint", str(trained_run / "checkpoint" / "step-2"), "--prompt", "To be",
                  "--max-new-tokens", "100000")
    assert "context of 64 positions" in err and "--max-new-tokens 100000" in err


@pytest.mark.parametrize("key, value", [
    ("pipeline_parallel_split_points", "layers.99"),
    ("pipeline_parallel_layers_per_stage", "2"),
    ("pipeline_parallel_schedule_csv", "schedule.csv"),
])
def test_pipeline_keys_without_a_pipeline_are_not_ignored(tmp_path, key, value):
    (tmp_path / "schedule.csv").write_text("0F0\n")
    err = refused("train", f"--parallelism.{key}", value, "--job.dump_folder", str(tmp_path / "o"), cwd=tmp_path)
    assert f"'parallelism.{key}'" in err and "pipeline_parallel_degree > 1" in err


def test_a_split_point_past_the_last_layer(tmp_path):
    err = refused("estimate-memory", "--world-size", "2", "--parallelism.pipeline_parallel_degree", "2",
                  "--parallelism.pipeline_parallel_split_points", "layers.99")
    assert "'layers.99'" in err and "layers.0 to layers.5" in err


def test_a_schedule_file_that_does_not_exist(tmp_path):
    err = refused("train", "--parallelism.pipeline_parallel_degree", "2",
                  "--parallelism.pipeline_parallel_schedule_csv", str(tmp_path / "missing.csv"))
    assert "missing.csv does not exist" in err


def test_a_schedule_file_that_is_a_fifo_does_not_block(tmp_path):
    fifo = tmp_path / "schedule.csv"
    os.mkfifo(fifo)
    err = refused("train", "--parallelism.pipeline_parallel_degree", "2",
                  "--parallelism.pipeline_parallel_schedule_csv", str(fifo))
    assert "is not a regular file" in err

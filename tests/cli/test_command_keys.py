"""A `--section.key VALUE` override that the subcommand does not read is one line on stderr, exit
code 2, before anything is loaded (titanctl/config/commands.py says what each command reads); keys
in the recipe are never refused, and an override the command reads still works."""

from __future__ import annotations

import json
import os

import pytest

from tests.cli_server import titanctl_run
from tests.conftest import OFFLINE_ENV, REPO

RECIPE = str(REPO / "recipes" / "llama3_debug.toml")


def run(args, cwd):
    env = {**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": "1"}
    return titanctl_run([*args], env=env, timeout=300, cwd=cwd)


def refused(args, tmp_path) -> str:
    """The one-line error of a refused command line, run from an empty folder that stays empty."""
    proc = run(args, tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == [], "the refused command wrote files"
    return lines[0]


def test_infer_tp_refuses_the_tensor_parallel_degree_before_looking_at_the_checkpoint(tmp_path):
    # The checkpoint does not exist: refused on the key, the command never got as far as the weights.
    line = refused(["infer-tp", "--checkpoint", str(tmp_path / "missing"), "--prompt", "hi",
                    "--parallelism.tensor_parallel_degree", "2"], tmp_path)
    assert line == (
        "error: --parallelism.tensor_parallel_degree is not read by infer-tp (its tensor-parallel degree is the "
        "world size); it reads: model.name, model.flavor, model.n_layers, model.n_kv_heads, model.norm_type, "
        "model.tokenizer_path, model.mtp_layers, training.seq_len, sft.chat_template_path, comm.init_timeout_seconds"
    )


@pytest.mark.parametrize(
    "args, expected",
    [
        (["estimate-memory", "--world-size", "2", "--checkpoint.interval", "5"],
         "error: --checkpoint.interval is not read by estimate-memory (checkpoints are not estimated); "),
        (["estimate-memory", "--world-size", "1", "--training.seed=3"],
         "error: --training.seed is not read by estimate-memory (only --validate reads it, for the real step); "),
        (["profile", "--config", RECIPE, "--training.steps", "3"],
         "error: --training.steps is not read by profile (--steps sets it); "),
        (["infer-tp", "--checkpoint", "ck", "--prompt", "hi", "--optimizer.lr", "1e-3"],
         "error: --optimizer.lr is not read by infer-tp (it only generates text); "),
    ],
)
def test_an_override_the_command_does_not_read_is_one_line(args, expected, tmp_path):
    assert refused(args, tmp_path).startswith(expected)


def test_estimate_memory_takes_a_key_it_reads_and_a_recipe_with_keys_it_does_not(tmp_path):
    # The recipe has [job], [checkpoint] and [metrics] keys, which estimate-memory does not read.
    proc = run(["estimate-memory", "--config", RECIPE, "--world-size", "2", "--json",
                "--parallelism.data_parallel_shard_degree", "2", "--model.n_layers", "1",
                "--training.seq_len", "32", "--training.local_batch_size", "1"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["degrees"]["dp_shard"] == 2 and report["world_size"] == 2

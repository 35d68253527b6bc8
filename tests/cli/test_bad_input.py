"""Careless and hostile command lines (issue 15, items 3, 4, 7 and 10): each is one line on stderr,
exit code 2, and nothing on disk changes (no dump folder, no file, nothing in the current folder)."""

from __future__ import annotations

import gzip
import json
import os
import socket

import pytest

from tests.cli_server import titanctl_run
from tests.conftest import OFFLINE_ENV, REPO


def snapshot(root):
    """Every path under root with its size and modification time."""
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


def run(args, cwd, **env):
    full_env = {**os.environ, **OFFLINE_ENV, **env}
    return titanctl_run([*args], env=full_env, timeout=120, cwd=cwd)


def refused(args, tmp_path, **env):
    """Run from an empty folder under tmp_path; check the one-line refusal and that nothing changed."""
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    before = snapshot(tmp_path)
    proc = run(args, cwd, **env)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert snapshot(tmp_path) == before, "the refused command changed files"
    return lines[0]


# ------------------------------------------------------------------- usage errors (item 3)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["estimate-memory"], "Missing option '--world-size'"),
        (["train", "--config"], "Option '--config' requires an argument"),
        (["profile", "--steps", "0"], "Invalid value for '--steps': Input should be greater than or equal to 1"),
        (["infer-tp", "--checkpoint", "ck", "--prompt", "x", "--temperature", "nan"],
         "Invalid value for '--temperature'"),
        (["infer-tp", "--checkpoint", "ck", "--prompt", "x", "--temperature", "-1"],
         "Invalid value for '--temperature': Input should be greater than or equal to 0"),
        (["infer-tp", "--checkpoint", "ck", "--prompt", "x", "--temperature", "inf"],
         "Invalid value for '--temperature': inf is not a finite number"),
        (["estimate-memory", "--world-size", "two"], "Invalid value for '--world-size'"),
        (["trian"], "No such command 'trian'. Did you mean 'train'?"),
        (["xyzzy"], "No such command 'xyzzy'; commands: train, rl, download-tokenizer,"),
        (["train", "--nope"], "unexpected argument '--nope'"),
        (["--nope"], "No such option: --nope"),
    ],
    ids=["missing-required", "option-without-value", "steps-0", "temperature-nan", "temperature-negative",
         "temperature-inf", "int-not-a-number", "typo-command", "unknown-command", "unknown-option",
         "unknown-global-option"],
)
def test_usage_errors_are_one_line(tmp_path, args, expected):
    line = refused(args, tmp_path)  # a profile run would have made ./outputs in the empty cwd
    assert expected in line


def test_debug_is_a_documented_global_option(tmp_path):
    proc = run(["--help"], tmp_path)
    assert proc.returncode == 0 and "--debug" in proc.stdout


def test_no_arguments_prints_the_help(tmp_path):
    proc = run([], tmp_path)
    assert proc.returncode == 2 and "train" in proc.stdout and "Traceback" not in proc.stderr


def test_debug_shows_the_traceback_of_a_usage_error(tmp_path):
    proc = run(["--debug", "estimate-memory"], tmp_path)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "MissingParameter" in proc.stderr


# ------------------------------------------------------ impossible config values (item 4)

TRAIN = ["train", "--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
         "--training.steps", "1"]


@pytest.mark.parametrize(
    "override, expected",
    [
        (["--optimizer.lr", "nan"], "'optimizer.lr' = nan must be a finite number > 0"),
        (["--optimizer.lr", "inf"], "'optimizer.lr' = inf must be a finite number > 0"),
        (["--optimizer.lr", "0"], "'optimizer.lr' = 0.0 must be > 0"),
        (["--optimizer.eps", "inf"], "'optimizer.eps' = inf must be a finite number in [0, 1]"),
        (["--optimizer.beta1", "5"], "'optimizer.beta1' = 5.0 must be in [0, 1)"),
        (["--optimizer.beta2", "nan"], "'optimizer.beta2' = nan must be a finite number in [0, 1)"),
        (["--training.max_norm", "nan"], "'training.max_norm' = nan must be a finite number >= 0"),
        (["--lr_scheduler.decay_ratio", "nan"], "'lr_scheduler.decay_ratio' = nan must be a finite number in [0, 1]"),
        (["--lr_scheduler.lr_min", "1.5"], "'lr_scheduler.lr_min' = 1.5 must be in [0, 1]"),
        (["--training.seed", str(2**64)], f"'training.seed' = {2**64} must be in [0, 2^64)"),
        (["--checkpoint.keep_latest_k", str(2**63)], "does not fit in 64 bits"),
        (["--training.steps", str(10**26)], "must be in [1, 1000000000]"),
        (["--job.dump_folder="], "'job.dump_folder' is empty"),
    ],
    ids=["lr-nan", "lr-inf", "lr-0", "eps-inf", "beta1-5", "beta2-nan", "max_norm-nan", "decay_ratio-nan",
         "lr_min-above-1", "seed-65-bits", "batch-64-bits", "steps-never-end", "dump_folder-empty"],
)
def test_impossible_values_are_refused_before_anything_is_written(tmp_path, override, expected):
    line = refused([*TRAIN, "--job.dump_folder", str(tmp_path / "out"), *override], tmp_path)
    assert expected in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "key, value",
    [
        ("checkpoint.folder", "{outside}"),  # absolute: it once wrote into /etc
        ("checkpoint.folder", "../../escaped"),
        ("metrics.save_tb_folder", "../tb"),
        ("profiling.save_traces_folder", "{outside}"),
        ("profiling.save_memory_snapshot_folder", "a/../../b"),
        ("checkpoint.folder", ""),
    ],
    ids=["checkpoint-absolute", "checkpoint-dotdot", "tb-dotdot", "traces-absolute", "snapshot-dotdot",
         "checkpoint-empty"],
)
def test_folders_stay_inside_the_dump_folder(tmp_path, key, value):
    outside = tmp_path / "outside"
    value = value.format(outside=outside)
    line = refused([*TRAIN, "--job.dump_folder", str(tmp_path / "out"), "--checkpoint.enable_checkpoint",
                    "--metrics.enable_tensorboard", f"--{key}={value}"], tmp_path)
    assert f"config key '{key}' = {value!r}" in line and "inside job.dump_folder" in line
    assert not (tmp_path / "out").exists() and not outside.exists() and not (tmp_path / "escaped").exists()


def test_non_utf8_recipe(tmp_path):
    recipe = tmp_path / "recipe.toml"
    raw = b"[training]\nsteps = 1\n# caf\xe9 in Latin-1\n"
    recipe.write_bytes(raw)
    line = refused(["train", "--config", str(recipe), "--job.dump_folder", str(tmp_path / "out")], tmp_path)
    assert f"{recipe} is not UTF-8 text (byte 0xe9 at offset {raw.index(0xE9)})" in line


def test_infer_seed_beyond_64_bits(tmp_path):
    line = refused(["infer-tp", "--checkpoint", str(tmp_path / "ck"), "--prompt", "x", "--seed", str(2**64)],
                   tmp_path)
    assert "Invalid value for '--seed': Input should be less than or equal to 18446744073709551615" in line


@pytest.mark.parametrize("value, expected", [("nan", "greater than or equal to 0"),  # nan >= 0 is false
                                             ("inf", "inf is not a finite number"),
                                             ("-1", "greater than or equal to 0")])
def test_straggler_pct_must_be_a_finite_percentage(tmp_path, value, expected):
    trace = tmp_path / "rank0_trace.json"
    trace.write_text(json.dumps({"traceEvents": []}))
    line = refused(["inspect-trace", str(trace), "--straggler-pct", value], tmp_path)
    assert "Invalid value for '--straggler-pct'" in line and expected in line


# ---------------------------------------------------------------- inspect-trace bombs (item 7)


def test_gzip_bomb_is_refused_at_the_bound(tmp_path):
    bomb = tmp_path / "rank0_trace.json.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as f:  # 3 MiB of JSON in about 3 KB
        f.write(b'{"traceEvents": [' + b" " * (3 << 20) + b"]}")
    line = refused(["inspect-trace", str(bomb), "--max-size-mib", "2"], tmp_path)
    assert f"{bomb} decompresses to more than 2 MiB: raise --max-size-mib to read it" in line
    proc = run(["inspect-trace", str(bomb), "--max-size-mib", "4"], tmp_path)  # a raised bound reads it
    assert "decompresses" not in proc.stderr


def test_deeply_nested_json_names_the_file(tmp_path):
    deep = tmp_path / "rank0_trace.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    line = refused(["inspect-trace", str(deep)], tmp_path)
    assert f"{deep}: JSON nested too deeply to be a trace or a dump" in line


# ----------------------------------------------------------------- download-tokenizer (item 10)


def test_download_tokenizer_says_what_it_does_and_fails_fast_when_the_hub_is_unreachable(tmp_path):
    with socket.socket() as s:  # a port on which nothing listens: connections are refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**{k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")},
           "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path / "hf_home")}
    (tmp_path / "hf_home").mkdir()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    before = snapshot(tmp_path)
    proc = titanctl_run(["download-tokenizer", "--local-dir", str(tmp_path / "tok")], env=env, timeout=120, cwd=cwd)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.strip() == (f"contacting http://127.0.0.1:{port} for original/tokenizer.model of "
                                   "meta-llama/Llama-3.1-8B")
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # no "Retrying in 1s [Retry 1/5]" lines
    assert f"is unreachable (cannot connect to 127.0.0.1:{port}" in lines[0]
    assert snapshot(tmp_path) == before


def test_download_tokenizer_default_repo_is_the_documented_one():
    from titanctl.data.download import DEFAULT_REPO_ID

    for doc in ("README.md", "docs/checkpoints.md"):
        text = (REPO / doc).read_text()
        assert f"--repo-id {DEFAULT_REPO_ID}" in text
        assert "Meta-Llama-3.1-8B" not in text


def test_download_tokenizer_model_picks_the_familys_repository(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    proc = titanctl_run(["download-tokenizer", "--model", "qwen3", "--local-dir", str(tmp_path / "tok")], env=env, timeout=120)
    assert proc.returncode == 2 and "tokenizer.json of Qwen/Qwen3-0.6B-Base" in proc.stderr, proc.stderr
    proc = titanctl_run(["download-tokenizer", "--model", "gpt2"], env=env, timeout=120)
    from titanctl.models.registry import FAMILIES

    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: unknown model family 'gpt2'; choose one of {', '.join(FAMILIES)}"), proc.stderr

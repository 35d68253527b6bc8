"""`titanctl rl` run as a user runs it (the CLI server's forks), a few steps from the session's trained
checkpoint: the metrics it logs, batch-invariant logprobs, bad input."""

import json
import os

import pytest

from tests.cli_server import titanctl_run
from tests.conftest import OFFLINE_ENV

# Four prompts x four completions of up to four tokens, on the 2-layer model of the session's trained run;
# the task's validation split (1,010 rows), which each run renders in a seventh of the train split's time.
TINY = ["--model.n_layers", "2", "--training.seq_len", "64", "--rl.split", "validation",
        "--rl.prompts_per_step", "4", "--rl.group_size", "4",
        "--rl.max_response_tokens", "4", "--training.local_batch_size", "8", "--rl.rewards", "tests.rl_rewards:digits",
        "--lr_scheduler.warmup_steps", "0", "--optimizer.lr", "1e-3"]
METRICS = {"step", "loss", "grad_norm", "lr", "reward_mean", "reward_std", "pass_rate", "response_length",
           "truncated", "groups_kept", "clip_fraction", "clip_low", "clip_high", "kl", "entropy", "logprob_diff_max",
           "logprob_diff_mean", "kl_sampler_trainer", "generation_tps", "training_tps", "step_time", "memory_gib",
           "tokens_seen"}


def run(repo, tmp_path, trained_run, *args, check=True):
    proc = titanctl_run(["rl", "--config", str(repo / "recipes" / "llama3_debug_grpo.toml"), *TINY,
                         "--checkpoint.initial_load_path", str(trained_run / "checkpoint" / "step-2"),
                         "--job.dump_folder", str(tmp_path / "rl"), *args],
                        env={**os.environ, **OFFLINE_ENV}, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def rows(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_few_steps_log_every_metric(repo, tmp_path, trained_run):
    proc = run(repo, tmp_path, trained_run, "--training.steps", "3", "--checkpoint.enable_checkpoint", "false")
    data = rows(tmp_path / "rl")
    assert [r["step"] for r in data] == [1, 2, 3]
    for r in data:
        assert set(r) == METRICS
        assert 0 <= r["reward_mean"] <= 1 and 0 < r["response_length"] <= 4 and r["generation_tps"] > 0
        assert 0 < r["logprob_diff_max"] < 1e-4  # the sampler's and the trainer's kernels round differently
    assert "step     3  reward" in proc.stdout


def test_batch_invariant_logprobs_equal_the_trainers_bitwise(repo, tmp_path, trained_run):
    run(repo, tmp_path, trained_run, "--training.steps", "3", "--checkpoint.enable_checkpoint", "false",
        "--rl.batch_invariant", "true", "--training.local_batch_size", "3")
    assert [r["logprob_diff_max"] for r in rows(tmp_path / "rl")] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("reward, says", [
    ("tests.rl_rewards:raises", "reward tests.rl_rewards:raises raised ValueError: this reward always fails on prompt "),
    ("tests.rl_rewards:not_a_number", "reward tests.rl_rewards:not_a_number returned nan, not a finite number, on "),
    ("tests.no_such_module:f", "rl.rewards entry 'tests.no_such_module:f': cannot import tests.no_such_module"),
])
def test_a_bad_reward_is_one_line(repo, tmp_path, trained_run, reward, says):
    proc = run(repo, tmp_path, trained_run, "--training.steps", "1", "--rl.rewards", reward, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in proc.stderr, proc.stderr


COMPARED = ("loss", "grad_norm", "reward_mean", "reward_std", "entropy", "kl", "logprob_diff_max", "response_length")


def test_a_resumed_run_continues_bitwise_with_its_reference_model(repo, tmp_path, trained_run):
    """Policy, optimizer, reference model, prompt order and sampler: steps 3-4 of a run resumed from its step-2
    checkpoint equal those of the run that went on (the schedule is constant: the recipe's lr_min = 1)."""
    kl = ["--rl.kl_coef", "0.1", "--checkpoint.interval", "2"]
    run(repo, tmp_path / "whole", trained_run, "--training.steps", "3", *kl)
    run(repo, tmp_path / "parts", trained_run, "--training.steps", "2", *kl)
    proc = run(repo, tmp_path / "parts", trained_run, "--training.steps", "3", *kl)
    assert "loaded checkpoint" in proc.stdout and "(step 2)" in proc.stdout
    saved = json.loads((tmp_path / "parts" / "rl" / "checkpoint" / "step-2" / "titanctl.json").read_text())
    assert "reference" in saved["contents"]
    whole, parts = rows(tmp_path / "whole" / "rl"), rows(tmp_path / "parts" / "rl")
    assert [r["step"] for r in parts] == [1, 2, 3]
    for got, want in zip(parts[2:], whole[2:]):
        assert {k: got[k] for k in COMPARED} == {k: want[k] for k in COMPARED}
    assert whole[-1]["kl"] > 0
    # Out of titanctl as after SFT: the policy's weights (the reference stays behind).
    hf = titanctl_run(["convert", str(tmp_path / "whole" / "rl" / "checkpoint" / "step-3"), str(tmp_path / "hf")],
                      env={**os.environ, **OFFLINE_ENV}, timeout=600)
    assert hf.returncode == 0 and (tmp_path / "hf" / "model.safetensors").exists(), hf.stderr  # one shard


def test_lora_policy_trains_adapters_and_exports_them(repo, tmp_path, trained_run):
    """LoRA on the trained base, with a KL penalty to the base itself (the adapters off): the checkpoint holds
    adapters only, and `convert --to peft` writes them for peft."""
    run(repo, tmp_path, trained_run, "--training.steps", "2", "--lora.enable", "--rl.kl_coef", "0.1",
        "--checkpoint.interval", "2", "--optimizer.lr", "1e-2")
    data = rows(tmp_path / "rl")
    assert data[0]["kl"] == 0 and data[-1]["kl"] > 0  # the policy left its base
    step = tmp_path / "rl" / "checkpoint" / "step-2"
    saved = json.loads((step / "titanctl.json").read_text())
    assert "lora" in saved and "reference" not in saved["contents"]
    peft = titanctl_run(["convert", str(step), str(tmp_path / "peft"), "--to", "peft"],
                        env={**os.environ, **OFFLINE_ENV}, timeout=600)
    assert peft.returncode == 0, peft.stderr
    assert (tmp_path / "peft" / "adapter_model.safetensors").exists()

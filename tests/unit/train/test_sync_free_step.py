"""No host sync per step: between log steps nothing in the loop reads a tensor on the host; a NaN is
still caught within metrics.log_freq steps, with the usual message, and never reaches a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed.workers.host_syncs import record_host_syncs
from titanctl.config.recipe import load_config
from titanctl.errors import TrainingDiverged
from titanctl.train.trainer import Trainer

TINY = ["--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--activation_checkpoint.mode", "none"]


def trainer(tmp_path, *extra: str) -> Trainer:
    return Trainer(load_config(None, [*TINY, "--job.dump_folder", str(tmp_path), *extra]))


def logged_steps(tmp_path) -> list[int]:
    return [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("extra", [[], ["--float8.enable_float8_linear", "--model.norm_type", "fused_rmsnorm",
                                        "--training.mixed_precision_param", "bfloat16"]],
                         ids=["plain", "float8_fused_norm_bf16"])
@pytest.mark.slow
def test_only_log_steps_read_tensors_on_the_host(tmp_path, extra):
    t = trainer(tmp_path, "--training.steps", "7", "--metrics.log_freq", "3", *extra)
    with record_host_syncs() as syncs:
        t.train()
    assert syncs.violations == syncs.first_step == [], "\n".join(syncs.violations + syncs.first_step)
    assert logged_steps(tmp_path) == [3, 6, 7]  # the log steps: every 3rd and the last
    assert syncs.allowed >= 3  # the recorder does see the log steps' reads


@pytest.mark.slow
def test_the_recorder_catches_a_sync_in_the_step(tmp_path):
    """The check above can fail: a .item() added to the step is reported."""
    t = trainer(tmp_path, "--training.steps", "2", "--metrics.log_freq", "2")
    step = t.train_step

    def syncing_step():
        grad_norm = step()
        grad_norm.item()
        return grad_norm

    t.train_step = syncing_step
    with record_host_syncs() as syncs:
        t.train()
    assert len(syncs.first_step) == 1 and "Tensor.item in syncing_step" in syncs.first_step[0]
    assert len(syncs.violations) == 1 and "Tensor.item in syncing_step" in syncs.violations[0]


def poison(t: Trainer, at_step: int) -> None:
    """Make the loss of step ``at_step`` NaN (the gradients stay finite, so later losses are not)."""

    class NaNAtStep:  # the step's own object otherwise (the trainer reads its figures too)
        def __init__(self, step):
            self.step = step

        def __call__(self, microbatches):
            loss = self.step(microbatches)
            return loss * float("nan") if t.step + 1 == at_step else loss

        def __getattr__(self, name):
            return getattr(self.step, name)

    t.forward_backward = NaNAtStep(t.forward_backward)


@pytest.mark.slow
def test_a_nan_between_log_steps_stops_the_run_at_the_next_log_step(tmp_path):
    t = trainer(tmp_path, "--training.steps", "9", "--metrics.log_freq", "3")
    poison(t, at_step=4)
    with pytest.raises(TrainingDiverged) as err:
        t.train()
    assert str(err.value) == (
        f"loss is nan at step 4; lower optimizer.lr (now {t.cfg.optimizer.lr}) or raise lr_scheduler.warmup_steps"
    )
    assert t.step == 6  # caught at the next log step, within metrics.log_freq steps
    assert logged_steps(tmp_path) == [3]


@pytest.mark.slow
def test_a_nan_never_reaches_a_checkpoint(tmp_path):
    t = trainer(tmp_path, "--training.steps", "9", "--metrics.log_freq", "5", "--checkpoint.enable_checkpoint",
                "--checkpoint.interval", "2")
    poison(t, at_step=3)
    with pytest.raises(TrainingDiverged, match="loss is nan at step 3"):
        t.train()
    assert t.step == 4  # the save of step 4 checked first
    saved = sorted(p.name for p in (tmp_path / "checkpoint").iterdir() if p.name.startswith("step-"))
    assert saved == ["step-2"]


@pytest.mark.slow
def test_an_infinite_loss_is_named_as_such(tmp_path):
    t = trainer(tmp_path, "--training.steps", "2", "--metrics.log_freq", "10")
    forward_backward = t.forward_backward
    t.forward_backward = lambda mbs: forward_backward(mbs) + float("inf")
    with pytest.raises(TrainingDiverged, match="loss is inf at step 1;"):
        t.train()
    assert t.step == 2  # the last step is a check too


def test_step_losses_stay_on_the_device_until_read():
    from titanctl.parallel.layouts.dims import ParallelDims
    from titanctl.parallel.layouts.reductions import StepLosses

    losses = StepLosses()
    for step, value in enumerate([2.0, 1.5, float("-inf"), float("nan"), 1.0], start=1):
        losses.record(step, torch.tensor(value))
    one = ParallelDims(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, world_size=1)
    loss, diverged = losses.read(one)
    assert loss == 1.0 and diverged == (3, float("-inf"))

"""Gradient clipping (training.max_norm): the gradients are scaled to the norm asked for, and a Trainer's
steps equal torch's own `clip_grad_norm_` + `torch.optim.AdamW` on the same model and batches.

It once did nothing: titanctl handed torch the gradient tensors where torch scales the ``.grad`` of what
it is given, and every layout skipped it alike. Under every layout, the layout tests' runs clip too
(tests/distributed/harness.py's TINY_RUN clips at 0.02, far below the norms of ~0.85).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from titanctl.config.recipe import load_config
from titanctl.parallel.layouts.dims import ParallelDims
from titanctl.parallel.layouts.reductions import clip_grad_norm
from titanctl.train.loss import IGNORE_INDEX
from titanctl.train.trainer import Trainer

ONE_PROCESS = ParallelDims(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, world_size=1)


def _params_with_grads(*grads: torch.Tensor | None) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g) if g is not None else torch.zeros(2))
        p.grad = None if g is None else g.clone()
        params.append(p)
    return params


def test_a_norm_above_max_norm_is_scaled_to_it_and_the_norm_before_is_returned():
    params = _params_with_grads(torch.tensor([3.0, 0.0]), torch.tensor([[0.0], [4.0]]), None)  # norm 5
    norm = clip_grad_norm(params, 1.0, ONE_PROCESS)
    assert norm.item() == pytest.approx(5.0)
    clipped = torch.cat([p.grad.flatten() for p in params if p.grad is not None])
    assert clipped.norm().item() == pytest.approx(1.0, rel=1e-6)
    assert clipped.tolist() == pytest.approx([0.6, 0.0, 0.0, 0.8], rel=1e-6)  # the direction is kept


@pytest.mark.parametrize("max_norm", [0.0, 5.0, 100.0], ids=["off", "at_the_norm", "above"])
def test_a_norm_at_or_below_max_norm_or_clipping_off_leaves_the_gradients(max_norm):
    params = _params_with_grads(torch.tensor([3.0, 4.0]))
    assert clip_grad_norm(params, max_norm, ONE_PROCESS).item() == pytest.approx(5.0)
    assert params[0].grad.tolist() == pytest.approx([3.0, 4.0], rel=1e-6)


TINY = ["--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.global_batch_size", "4",  # two microbatches a step: clipping comes after accumulation
        "--training.mixed_precision_param", "float32", "--activation_checkpoint.mode", "none",
        "--training.steps", "4", "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_type", "linear",
        "--lr_scheduler.lr_min", "0.1", "--optimizer.lr", "1e-2", "--optimizer.beta1", "0.8",
        "--optimizer.beta2", "0.9", "--optimizer.eps", "1e-6", "--optimizer.weight_decay", "0.05",
        "--optimizer.implementation", "for-loop", "--metrics.log_freq", "1"]
# warmup (step + 1) / 3 for two steps, then a linear decay over the last two to lr_min = 0.1
LR_FACTORS = [1 / 3, 2 / 3, 0.1 + 0.9 * 0.5, 0.1]


def _train(tmp_path, max_norm: str):
    """(the model before training, the step's microbatches, each step's grad norm, the model after)."""
    t = Trainer(load_config(None, [*TINY, "--training.max_norm", max_norm, "--job.dump_folder", str(tmp_path)]))
    initial = copy.deepcopy(t.model_parts[0])
    steps = []
    forward_backward = t.forward_backward

    def recording(microbatches):
        steps.append([tuple(x.clone() for x in mb) for mb in microbatches])
        return forward_backward(microbatches)

    t.forward_backward = recording
    norms = [t.train_step() for _ in range(4)]
    return initial, steps, [n.item() for n in norms], t.model_parts[0]


def _reference(model: torch.nn.Module, steps, max_norm: float) -> list[float]:
    """torch's own clip_grad_norm_ and AdamW, with the settings TINY gives, by hand: each step's norm."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05,
                            foreach=False)
    norms = []
    for factor, microbatches in zip(LR_FACTORS, steps):
        counted = sum((labels != IGNORE_INDEX).sum() for _, labels in microbatches)
        for inputs, labels in microbatches:
            logits = model(inputs)
            (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / counted).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf")).item())
        opt.param_groups[0]["lr"] = 1e-2 * factor
        opt.step()
        opt.zero_grad()
    return norms


def _max_rel_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    ours = dict(a.named_parameters())
    return max(((ours[n] - p).abs().max() / p.abs().max()).item() for n, p in b.named_parameters())


@pytest.mark.slow
def test_trainer_steps_equal_torch_clip_grad_norm_and_adamw(tmp_path):
    initial, steps, norms, trained = _train(tmp_path / "clipped", "0.02")
    reference = copy.deepcopy(initial)
    ref_norms = _reference(reference, steps, 0.02)
    assert norms == pytest.approx(ref_norms, rel=1e-5)  # the logged norm is the one before clipping
    assert min(norms) > 10 * 0.02  # every step clipped, hard
    assert _max_rel_diff(trained, reference) < 1e-5

    # The same steps unclipped end elsewhere: the comparison above sees the clipping.
    unclipped = copy.deepcopy(initial)
    _reference(unclipped, steps, 0.0)
    assert _max_rel_diff(trained, unclipped) > 1e-2

    _, _, _, trained_off = _train(tmp_path / "off", "0")
    assert _max_rel_diff(trained_off, unclipped) < 1e-5

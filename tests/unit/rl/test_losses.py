"""GRPO, DAPO, Dr.GRPO and GSPO losses, advantages and the sampler-mismatch correction, each against a
hand-written reference of trl 1.16's GRPOTrainer definitions (written out token by token here, not
vectorized), and the global divisor that makes gradient accumulation equal one batch."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from titanctl.config.job_config import RL
from titanctl.rl import advantages as adv
from titanctl.rl import losses

B, R, G = 8, 5, 4  # completions (two groups of four), response tokens


def batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 1, 4, 2, 5, 5, 3])
    mask = (torch.arange(R) < lengths[:, None]).float()
    old = -torch.rand(B, R, generator=gen) * 3
    new = (old + torch.randn(B, R, generator=gen) * 0.3).requires_grad_(True)  # pi drifted from pi_old
    ref = old + torch.randn(B, R, generator=gen) * 0.2
    sampler = old + torch.randn(B, R, generator=gen) * 0.5
    advantages = torch.randn(B, generator=gen)
    return new, old, ref, sampler, advantages, mask


def reference_loss(cfg: RL, new, old, ref, advantages, mask, correction=None) -> torch.Tensor:
    """trl 1.16's _compute_loss, one completion and one token at a time."""
    high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    per_sequence, total, tokens = [], 0.0, 0
    for i in range(B):
        valid = [t for t in range(R) if mask[i, t] > 0]
        if cfg.importance_sampling_level == "sequence":
            seq_ratio = torch.exp(sum(new[i, t] - old[i, t] for t in valid) / max(1, len(valid)))
        row = []
        for t in valid:
            ratio = seq_ratio if cfg.importance_sampling_level == "sequence" else torch.exp(new[i, t] - old[i, t])
            clipped = torch.clamp(ratio, 1 - cfg.epsilon, 1 + high)
            loss = -torch.min(ratio * advantages[i], clipped * advantages[i])
            if correction is not None:
                loss = loss * correction[i, t if correction.shape[1] > 1 else 0]
            if cfg.kl_coef:
                loss = loss + cfg.kl_coef * (torch.exp(ref[i, t] - new[i, t]) - (ref[i, t] - new[i, t]) - 1)
            row.append(loss)
        total, tokens = total + sum(row), tokens + len(row)
        per_sequence.append(sum(row) / max(1, len(row)))
    if cfg.loss_type == "grpo":
        return sum(per_sequence) / B
    if cfg.loss_type == "dapo":
        return total / tokens
    return total / (B * cfg.max_response_tokens)  # dr_grpo


def ours(cfg: RL, new, old, ref, advantages, mask, correction=None, microbatch: int = B) -> torch.Tensor:
    """The loss as titanctl's update computes it: microbatch sums over the global divisor."""
    kept = (mask.sum(-1) > 0).float()
    divisor = losses.global_count(cfg, mask, kept)
    total = 0.0
    for start in range(0, B, microbatch):
        rows = slice(start, start + microbatch)
        token = losses.token_loss(cfg, new[rows], old[rows], advantages[rows], mask[rows],
                                  ref[rows] if cfg.kl_coef else None, None if correction is None else correction[rows])
        total = total + losses.summed(cfg, token.loss, mask[rows]) / divisor
    return total


CONFIGS = {
    "grpo": RL(loss_type="grpo", max_response_tokens=R),
    "grpo_kl": RL(loss_type="grpo", kl_coef=0.04, max_response_tokens=R),
    "dapo": RL(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, max_response_tokens=R),
    "dr_grpo": RL(loss_type="dr_grpo", scale_rewards="none", max_response_tokens=R),
    "gspo": RL(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4,
               max_response_tokens=R),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_each_loss_equals_its_reference_with_its_gradient(name):
    cfg = CONFIGS[name]
    new, old, ref, _, advantages, mask = batch()
    got = ours(cfg, new, old, ref, advantages, mask)
    (grad_got,) = torch.autograd.grad(got, new)
    want = reference_loss(cfg, new, old, ref, advantages, mask)
    (grad_want,) = torch.autograd.grad(want, new)
    assert got.item() == pytest.approx(want.item(), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-5, atol=1e-7)
    assert grad_got[mask == 0].abs().max() == 0  # padding gets nothing


def test_the_losses_differ_from_each_other():
    """The references are not all one formula: each config gives its own value on the same batch."""
    values = [round(ours(cfg, *batch()[:3], *batch()[4:]).item(), 6) for cfg in CONFIGS.values()]
    assert len(set(values)) == len(values), values


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_gradient_accumulation_equals_one_batch(name):
    """Microbatches of 3 (uneven: 3, 3, 2) with the global divisor give the whole batch's loss and gradient;
    a mean of per-microbatch means would not (checked: it differs)."""
    cfg = CONFIGS[name]
    new, old, ref, _, advantages, mask = batch(1)
    whole = ours(cfg, new, old, ref, advantages, mask)
    (grad_whole,) = torch.autograd.grad(whole, new)
    split = ours(cfg, new, old, ref, advantages, mask, microbatch=3)
    (grad_split,) = torch.autograd.grad(split, new)
    assert split.item() == pytest.approx(whole.item(), rel=1e-6)
    torch.testing.assert_close(grad_split, grad_whole, rtol=1e-6, atol=1e-8)
    means = sum(ours(cfg, new[s:s + 3], old[s:s + 3], ref[s:s + 3], advantages[s:s + 3], mask[s:s + 3]).item()
                for s in range(0, B, 3)) / 3
    assert abs(means - whole.item()) > 1e-4


def test_on_policy_ratio_is_one_and_the_gradient_is_the_policy_gradient():
    """updates_per_rollout = 1: pi_old = pi detached, so the loss is -A (mean) and its gradient -A / length
    per token (grpo), never clipped."""
    cfg = CONFIGS["grpo"]
    new, _, ref, _, advantages, mask = batch(2)
    token = losses.token_loss(cfg, new, new.detach(), advantages, mask)
    assert not token.low_clipped.any() and not token.high_clipped.any()
    loss = losses.summed(cfg, token.loss, mask) / B
    (grad,) = torch.autograd.grad(loss, new)
    want = -advantages[:, None] * mask / mask.sum(-1, keepdim=True) / B
    torch.testing.assert_close(grad, want)


def test_clipping_is_counted_on_the_side_that_binds():
    cfg = RL(epsilon=0.2, epsilon_high=0.28)
    new = torch.log(torch.tensor([[0.7, 1.3, 1.0], [0.7, 1.3, 1.0]]))
    token = losses.token_loss(cfg, new, torch.zeros(2, 3), torch.tensor([-1.0, 1.0]), torch.ones(2, 3))
    assert token.low_clipped.tolist() == [[True, False, False], [False, False, False]]
    assert token.high_clipped.tolist() == [[False, False, False], [False, True, False]]


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_correction_equals_trl(mode):
    """trl 1.16's vLLM importance sampling (clip_min unset): exp of the per-token or per-completion summed
    (trainer - sampler) difference, clamped to the cap (truncate) or zeroed above it (mask)."""
    cfg = RL(importance_correction=mode, importance_cap=2.0, max_response_tokens=R)
    _, old, _, sampler, _, mask = batch(3)
    got = losses.correction_weights(cfg, old, sampler, mask)
    for i in range(B):
        diffs = [(old[i, t] - sampler[i, t]).item() * mask[i, t].item() for t in range(R)]
        ratios = [math.exp(sum(diffs))] if mode.startswith("sequence") else [math.exp(d) for d in diffs]
        for t, ratio in enumerate(ratios):
            want = min(ratio, 2.0) if mode.endswith("truncate") else (0.0 if ratio > 2.0 else ratio)
            assert got[i, t].item() == pytest.approx(want, rel=1e-6)
    assert losses.correction_weights(RL(), old, sampler, mask) is None
    # and it weighs each token's loss
    new = old.clone().requires_grad_(True)
    want = reference_loss(CONFIGS["grpo"], new, old, old, torch.ones(B), mask, got)
    assert ours(CONFIGS["grpo"], new, old, old, torch.ones(B), mask, got).item() == pytest.approx(want.item(), rel=1e-6)


# ----------------------------------------------------------------------------- advantages


def test_group_advantages_equal_trl():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 3.0, 1.0, 2.0]])
    got = adv.group_advantages(rewards, "group")
    for g in range(3):
        values = rewards[g].tolist()
        mean, std = statistics.mean(values), statistics.stdev(values)  # Bessel-corrected, as trl's nanstd
        for j in range(G):
            assert got[g, j].item() == pytest.approx((values[j] - mean) / (std + 1e-4), rel=1e-6, abs=1e-7)
    assert adv.group_advantages(rewards, "none").tolist() == (rewards - rewards.mean(1, keepdim=True)).tolist()
    flat = rewards.flatten().tolist()
    spread = adv.batch_std(rewards.flatten(), lambda t: t)
    assert spread.item() == pytest.approx(statistics.stdev(flat), rel=1e-6)
    batch_scaled = adv.group_advantages(rewards, "batch", spread)
    assert batch_scaled[2, 1].item() == pytest.approx((3.0 - 1.5) / (statistics.stdev(flat) + 1e-4), rel=1e-6)
    assert adv.kept_groups(rewards).tolist() == [True, False, True]


def test_overlong_penalty_is_dapos_soft_punishment():
    """trl 1.16's get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4)."""
    def trl(length, max_len=8, cache=4):
        if length <= max_len - cache:
            return 0.0
        return (max_len - cache - length) / cache if length <= max_len else -1.0

    lengths = torch.arange(1, 9)
    assert adv.overlong_penalty(lengths, 8, 4, 1.0).tolist() == pytest.approx([trl(n) for n in range(1, 9)])
    assert adv.overlong_penalty(lengths, 8, 4, 0.5).tolist() == pytest.approx([trl(n) / 2 for n in range(1, 9)])
    assert adv.overlong_penalty(lengths, 8, 0, 1.0).tolist() == [0.0] * 8


def test_entropy_of_a_uniform_distribution_is_log_v():
    assert losses.entropy(torch.zeros(2, 7)).tolist() == pytest.approx([math.log(7)] * 2)

"""On-device sampling: greedy, temperature and top-k behave, and the noise is a function of the
seed and the position only (so every device and every TP degree draws the same numbers)."""

from __future__ import annotations

import pytest
import torch

from titanctl.inference.sampling import Sampling, mix32, sample, seed_key, uniform

LOGITS = torch.tensor([[0.0, 1.0, 2.0, float("-inf"), 0.5]])  # (1, vocab)


def draws(logits: torch.Tensor, sampling: Sampling, n: int, seed: int = 0) -> torch.Tensor:
    """The token drawn at each of n positions: n independent draws."""
    key = torch.tensor(seed_key(seed))
    return torch.cat([sample(logits, sampling, key, torch.tensor([p])) for p in range(n)]).flatten()


def test_mix32_is_the_same_on_python_ints_and_tensors():
    values = [0, 1, 2, 12345, 2**31 - 1, 2**32 - 1]
    hashed = mix32(torch.tensor(values))
    assert hashed.tolist() == [mix32(v) for v in values]
    assert all(0 <= h < 2**32 for h in hashed.tolist())
    assert len(set(hashed.tolist())) == len(values)


def test_seed_key_folds_every_bit_of_a_large_seed():
    assert seed_key(7) != seed_key(7 + 2**32) != seed_key(7 + 2**64)
    assert 0 <= seed_key(2**100 + 3) < 2**32


def test_uniform_is_in_the_open_interval_and_depends_on_key_and_position_only():
    key = torch.tensor(seed_key(3))
    u = uniform(key, torch.tensor([5]), 20000)
    assert u.dtype == torch.float32 and bool(((u > 0) & (u < 1)).all())
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.003
    assert torch.histc(u, bins=10, min=0, max=1).sub(2000).abs().max() < 200  # flat
    assert torch.equal(u, uniform(key.clone(), torch.tensor([5]), 20000))
    assert not torch.equal(u, uniform(key, torch.tensor([6]), 20000))
    assert not torch.equal(u, uniform(torch.tensor(seed_key(4)), torch.tensor([5]), 20000))
    # The noise of an entry does not depend on how many entries were asked for.
    assert torch.equal(u[:100], uniform(key, torch.tensor([5]), 100))


def test_greedy_is_the_argmax():
    assert draws(LOGITS, Sampling(0.0), 5).tolist() == [2] * 5


@pytest.mark.slow
def test_sampling_follows_the_softmax_of_logits_over_temperature():
    n = 4000
    for temperature in (1.0, 0.5):
        counts = torch.bincount(draws(LOGITS, Sampling(temperature), n), minlength=5).float()
        expected = torch.softmax(LOGITS[0] / temperature, 0) * n
        assert counts[3] == 0  # probability 0 is never drawn
        torch.testing.assert_close(counts, expected, rtol=0.12, atol=15)


def test_top_k_keeps_only_the_k_likeliest():
    assert set(draws(LOGITS, Sampling(1.0, top_k=2), 300).tolist()) == {1, 2}
    assert draws(LOGITS, Sampling(5.0, top_k=1), 50).tolist() == [2] * 50  # top-k 1 is greedy
    assert set(draws(LOGITS, Sampling(1.0, top_k=10), 2000).tolist()) == {0, 1, 2, 4}  # k >= vocab: all


def test_low_temperature_is_greedy_and_high_temperature_is_near_uniform():
    assert draws(LOGITS, Sampling(1e-3), 200).tolist() == [2] * 200
    counts = torch.bincount(draws(LOGITS, Sampling(1e3), 4000), minlength=5)
    assert counts[3] == 0 and counts[[0, 1, 2, 4]].min() > 850


@pytest.mark.parametrize("seed", [0, 1])
def test_a_seed_draws_the_same_tokens_whatever_else_runs(seed):
    first = draws(LOGITS, Sampling(1.0), 50, seed)
    torch.rand(100)  # the global generator is not involved
    assert torch.equal(draws(LOGITS, Sampling(1.0), 50, seed), first)
    assert not torch.equal(draws(LOGITS, Sampling(1.0), 50, seed + 2), first)

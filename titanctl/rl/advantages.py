"""From rewards to advantages: group-relative, as GRPO and its successors define them (trl 1.16's names).

Rewards arrive as (groups, G): the G completions of one prompt in a row. ``rl.scale_rewards``:

- ``group`` (GRPO): (r - mean of the group) / (std of the group + 1e-4);
- ``batch``: the same, divided by the std over the whole rollout (every rank's groups) instead;
- ``none`` (Dr.GRPO): r - mean of the group, not divided.

std is Bessel-corrected (n - 1), as trl's ``nanstd``. DAPO adds two things: its soft overlong punishment
(``overlong_penalty``), which is part of the reward, and dynamic sampling: a group whose rewards are all
equal teaches nothing (its advantages are 0) and, with ``rl.dynamic_sampling``, leaves the loss and its
counts (``kept_groups``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

EPS = 1e-4  # trl's, against a zero std


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment of each completion's length (its tokens, a final stop included):
    0 up to ``max_tokens - buffer`` tokens, then falling linearly to ``-penalty`` at ``max_tokens``."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    over = (lengths.float() - (max_tokens - buffer)).clamp(min=0) / buffer
    return -penalty * over.clamp(max=1.0)


def group_advantages(rewards: torch.Tensor, scale: str, batch_std: torch.Tensor | None = None) -> torch.Tensor:
    """(groups, G) rewards -> (groups, G) advantages; ``batch_std``: the std over the whole rollout
    (``scale`` = batch; computed over every rank by the caller)."""
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "none":
        return centered
    if scale == "group":
        return centered / (rewards.std(dim=1, keepdim=True) + EPS)
    if scale == "batch":
        return centered / (batch_std + EPS)
    raise ValueError(f"scale_rewards {scale!r} is not one of group, batch, none")


def batch_std(rewards: torch.Tensor, reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The Bessel-corrected std of every rank's rewards (two passes, as ``torch.std``); ``reduce_sum`` sums a
    tensor over the data-parallel ranks (the identity in one process)."""
    total, count = reduce_sum(torch.stack([rewards.sum(), torch.tensor(float(rewards.numel()))])).unbind()
    mean = total / count
    squares = reduce_sum(((rewards - mean) ** 2).sum())
    return (squares / (count - 1)).sqrt()


def kept_groups(rewards: torch.Tensor) -> torch.Tensor:
    """(groups,) bool: the groups whose rewards are not all equal (dynamic sampling keeps them)."""
    return (rewards != rewards[:, :1]).any(dim=1)

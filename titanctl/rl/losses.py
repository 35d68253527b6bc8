"""The policy loss of GRPO, DAPO, Dr.GRPO and GSPO, as trl 1.16's ``GRPOTrainer`` defines them.

Per token t of completion i (``rl.*`` keys in brackets):

    w_it   = pi(y_it) / pi_old(y_it)                         [importance_sampling_level = token]
           = exp(mean over i's tokens of log pi - log pi_old)  [= sequence: GSPO, one w_i for every token]
    loss_it = -min(w_it A_i, clip(w_it, 1 - epsilon, 1 + epsilon_high) A_i) * c_it + kl_coef * KL_it
    KL_it  = exp(ref - log pi) - (ref - log pi) - 1          (k3, to the frozen reference)

with c_it the sampler-mismatch correction (``rl.importance_correction``, 1 without it). Then
[``loss_type``]: grpo averages each completion's tokens, then the completions; dapo sums every token and
divides by the count of response tokens; dr_grpo divides the sum by completions x max_response_tokens.
Every count is the global one, over all microbatches and data-parallel ranks, computed before the first
microbatch, so that gradient accumulation and every layout give one process's loss: each microbatch adds
its own sum divided by the global count (``divisor``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titanctl.config.job_config import RL


@dataclass
class TokenLoss:
    loss: torch.Tensor  # (B, R) per-token loss (masked tokens included: the caller masks)
    low_clipped: torch.Tensor  # (B, R) bool: the ratio fell below 1 - epsilon with a negative advantage
    high_clipped: torch.Tensor  # (B, R) bool: above 1 + epsilon_high with a positive advantage
    kl: torch.Tensor | None  # (B, R) k3 KL to the reference, or None


def token_loss(cfg: RL, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, ref_logprobs: torch.Tensor | None = None,
               correction: torch.Tensor | None = None) -> TokenLoss:
    """logprobs (B, R) under the policy being trained, old_logprobs (B, R) detached, advantages (B,),
    mask (B, R) 1 on response tokens; ref_logprobs (B, R) when rl.kl_coef > 0; correction (B, R) or (B, 1)."""
    log_ratio = logprobs - old_logprobs
    if cfg.importance_sampling_level == "sequence":  # GSPO: the mean log-ratio of each completion
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    ratio = torch.exp(log_ratio)  # (B, R), or (B, 1) broadcast to every token
    high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    clipped = torch.clamp(ratio, 1 - cfg.epsilon, 1 + high)
    adv = advantages[:, None]
    loss = -torch.min(ratio * adv, clipped * adv)
    if correction is not None:
        loss = loss * correction
    kl = None
    if cfg.kl_coef:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1
        loss = loss + cfg.kl_coef * kl
    shape = logprobs.shape
    return TokenLoss(loss, ((ratio < 1 - cfg.epsilon) & (adv < 0)).expand(shape),
                     ((ratio > 1 + high) & (adv > 0)).expand(shape), kl)


def summed(cfg: RL, loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A microbatch's share of the loss before the global division: for grpo the sum of each completion's
    token mean, else the sum over tokens."""
    masked = loss * mask
    if cfg.loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    return masked.sum()


def global_count(cfg: RL, mask: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
    """This rank's part of the divisor (the caller sums it over the ranks): its kept completions (grpo),
    their response tokens (dapo), or completions x max_response_tokens (dr_grpo)."""
    if cfg.loss_type == "grpo":
        return sequences.sum().float()
    if cfg.loss_type == "dapo":
        return mask.sum().float()
    return sequences.sum().float() * cfg.max_response_tokens


def correction_weights(cfg: RL, trainer: torch.Tensor, sampler: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor | None:
    """rl.importance_correction: exp(trainer - sampler logprob) per token, or of its sum per completion,
    truncated at rl.importance_cap (TIS) or zeroed above it (MIS); None without correction."""
    mode = cfg.importance_correction
    if mode == "none":
        return None
    diff = (trainer - sampler) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    weights = torch.exp(diff)
    if mode.endswith("truncate"):
        return weights.clamp(max=cfg.importance_cap)
    return weights.masked_fill(weights > cfg.importance_cap, 0.0)


def entropy(scores: torch.Tensor) -> torch.Tensor:
    """(..., V) tempered logits -> (...) the entropy of their softmax."""
    logp = torch.log_softmax(scores, dim=-1)
    return -(logp.exp() * logp).sum(-1)

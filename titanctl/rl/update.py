"""One policy update on a rollout's batch: every microbatch's forward, logprobs, loss and backward.

The loss divides by the global count of what it averages (titanctl.rl.losses), computed before the first
microbatch; each data-parallel rank's microbatches add their sums over that count times the
data-parallel degree, and FSDP/DDP average the gradients over the ranks: the gradient is one process's.
The first update of a rollout also fixes what the later ones reuse: pi_old (its own logprobs, detached),
the reference's logprobs and the sampler-mismatch correction; and it measures the mismatch itself, the
sampler's logprob of each token against the trainer's at the parameters that sampled it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from titanctl.config.job_config import RL
from titanctl.rl import losses
from titanctl.rl.rollout import RouteRecorder, logits_at, token_logprobs


@dataclass
class Batch:
    """A rank's rollout, scored: row r is one completion (rows of a group adjacent)."""

    tokens: torch.Tensor  # (B, P_max + R) prompt, response, padding
    prompt_lengths: torch.Tensor  # (B,)
    response_lengths: torch.Tensor  # (B,)
    sampler_logprobs: torch.Tensor  # (B, R)
    mask: torch.Tensor  # (B, R) fp32: 1 on the response tokens the loss counts (kept groups)
    advantages: torch.Tensor  # (B,)
    routes: dict[int, torch.Tensor] | None = None  # routing replay: layer -> (B, L, k)
    old_logprobs: torch.Tensor | None = None  # (B, R), set by the first update
    ref_logprobs: torch.Tensor | None = None
    correction: torch.Tensor | None = None
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # the first update's mismatch measures

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]


def response_logprobs(model: nn.Module, tokens: torch.Tensor, prompt_lengths: torch.Tensor, length: int,
                      max_response: int, temperature: float, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs (B, R), tempered scores (B, R, vocab)) of each row's response tokens under ``model``, whose
    input is the first ``length`` tokens of each row: response token j of row r sits at prompt_lengths[r] + j
    and is scored by the logits of the position before it."""
    positions = (prompt_lengths - 1)[:, None] + torch.arange(max_response, device=tokens.device)
    positions = positions.clamp(max=length - 1)  # past a row's end: padding, masked
    with logits_at(model, positions):
        logits = model(tokens[:, :length])  # (B, R, V)
    scores = logits[..., :vocab].float() / temperature
    targets = tokens.gather(1, positions + 1)
    return token_logprobs(scores, targets), scores


@dataclass
class PolicyUpdate:
    cfg: RL
    model: nn.Module
    local_batch_size: int
    vocab: int
    reduce_sum: Callable[[torch.Tensor], torch.Tensor]  # over the data-parallel ranks
    dp: int
    forward_context: Callable = nullcontext  # autocast, batch-invariant kernels
    reference: nn.Module | None = None  # the frozen reference (rl.kl_coef); None with LoRA: adapters off
    adapters_off: Callable | None = None  # LoRA: a context under which the policy is its base
    recorder: RouteRecorder | None = None

    def __call__(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Accumulate the gradient of the loss over ``batch``; returns the update's sums (device tensors)."""
        cfg = self.cfg
        first = batch.old_logprobs is None
        if first:
            batch.old_logprobs = torch.zeros_like(batch.sampler_logprobs)
            batch.ref_logprobs = torch.zeros_like(batch.sampler_logprobs) if cfg.kl_coef else None
        kept = (batch.mask.sum(-1) > 0).float()
        divisor = self.reduce_sum(losses.global_count(cfg, batch.mask, kept)).clamp(min=1.0) / self.dp
        sums = {name: torch.zeros(()) for name in ("loss", "low_clipped", "high_clipped", "kl")}
        for start in range(0, batch.rows, self.local_batch_size):
            rows = slice(start, start + self.local_batch_size)
            self._microbatch(batch, rows, divisor, first, sums)
        if first:
            self._mismatch(batch)
        return sums

    def _microbatch(self, batch: Batch, rows: slice, divisor: torch.Tensor, first: bool, sums: dict) -> None:
        cfg = self.cfg
        tokens, starts, mask = batch.tokens[rows], batch.prompt_lengths[rows], batch.mask[rows]
        length = int((starts + batch.response_lengths[rows]).max()) - 1  # inputs: all but the last token
        routes = None
        if batch.routes is not None:
            routes = {i: r[rows, :length].reshape(-1, r.shape[-1]) for i, r in batch.routes.items()}
        score = (tokens, starts, length, cfg.max_response_tokens, cfg.temperature, self.vocab)
        replay = self.recorder.replay(routes) if self.recorder is not None else nullcontext()
        with replay:  # also around backward: activation checkpointing routes again there
            with self.forward_context():
                logprobs, scores = response_logprobs(self.model, *score)
            if first:
                batch.old_logprobs[rows] = logprobs.detach()
                if cfg.kl_coef:
                    batch.ref_logprobs[rows] = self._reference_logprobs(score)
                entropy = losses.entropy(scores.detach())
                batch.stats["entropy"] = batch.stats.get("entropy", 0) + (entropy * (mask > 0)).sum()
            del scores
            old = batch.old_logprobs[rows]
            correction = None
            if cfg.importance_correction != "none":
                if first:
                    weights = losses.correction_weights(cfg, old, batch.sampler_logprobs[rows], mask)
                    if batch.correction is None:
                        batch.correction = torch.zeros(batch.rows, weights.shape[1])
                    batch.correction[rows] = weights
                correction = batch.correction[rows]
            ref = batch.ref_logprobs[rows] if cfg.kl_coef else None
            token = losses.token_loss(cfg, logprobs, old, batch.advantages[rows], mask, ref, correction)
            part = losses.summed(cfg, token.loss, mask) / divisor
            part.backward()
        counted = mask > 0
        sums["loss"] += part.detach() / self.dp
        sums["low_clipped"] += (token.low_clipped & counted).sum()
        sums["high_clipped"] += (token.high_clipped & counted).sum()
        if token.kl is not None:
            sums["kl"] += (token.kl.detach() * mask).sum()

    @torch.no_grad()
    def _reference_logprobs(self, score: tuple) -> torch.Tensor:
        if self.reference is not None:
            with self.forward_context():
                return response_logprobs(self.reference, *score)[0]
        with self.adapters_off(), self.forward_context():
            return response_logprobs(self.model, *score)[0]

    @staticmethod
    def _mismatch(batch: Batch) -> None:
        """The sampler's logprobs against the trainer's at the same parameters (the first update's)."""
        counted = batch.response_lengths[:, None] > torch.arange(batch.mask.shape[1])
        diff = (batch.sampler_logprobs - batch.old_logprobs)[counted]
        batch.stats["logprob_diff_max"] = diff.abs().max() if diff.numel() else torch.zeros(())
        batch.stats["logprob_diff_sum"] = diff.abs().sum()
        batch.stats["kl_sampler_trainer_sum"] = diff.sum()  # E over sampled tokens of log s - log t
        batch.stats["scored_tokens"] = torch.tensor(float(diff.numel()))

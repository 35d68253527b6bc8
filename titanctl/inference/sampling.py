"""Choosing the next token on the device, with random numbers that depend only on the seed.

Greedy (temperature 0) is the argmax. Sampling adds Gumbel noise to ``logits / temperature``
(top-k kept) and takes the argmax, which draws exactly from the softmax. The noise of vocabulary
entry ``j`` for the token at position ``p`` is a hash of (seed, p, j) computed with tensor ops:
no generator state, no host round trip, the same numbers on any device, under ``torch.compile``
and on every rank of a tensor-parallel job (each holds the whole vocabulary's logits), so ranks
agree on every token without a broadcast and a seed gives the same text at every TP degree.
An id the tokenizer cannot decode (an embedding row past its vocabulary, ``Sampling.vocab``) is
never chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK = 0xFFFFFFFF
# An odd multiplier below 2**27 that scrambles well: a 32-bit value times it stays below 2**63,
# so int64 tensors compute the hash exactly (no overflow) on every device.
_MULTIPLIER = 0x45D9F3B
_STRIDE = 0x9E3779B1  # spreads consecutive vocabulary ids far apart before hashing


def mix32(x):
    """A 32-bit integer hash (avalanching: each input bit flips about half the output bits).

    Works on Python ints and on int64 tensors holding values in [0, 2**32) alike.
    """
    x = ((x >> 16) ^ x) * _MULTIPLIER & _MASK
    x = ((x >> 16) ^ x) * _MULTIPLIER & _MASK
    return (x >> 16) ^ x


def seed_key(seed: int) -> int:
    """Fold a seed of any size into 32 bits (every 32-bit chunk of it counts)."""
    key, rest = mix32(seed & _MASK), seed >> 32
    while rest:
        key, rest = mix32(key ^ (rest & _MASK)), rest >> 32
    return key


def uniform(key: torch.Tensor, position: torch.Tensor, n: int) -> torch.Tensor:
    """n numbers in (0, 1), float32, a function of (key, position) only.

    key: int64 scalar tensor from :func:`seed_key`; position: int64 tensor of one element.
    """
    stream = mix32(key ^ mix32(position.reshape(()) & _MASK))
    ids = torch.arange(n, device=position.device, dtype=torch.int64)
    bits = mix32((stream + ids * _STRIDE) & _MASK)
    return ((bits >> 8).float() + 0.5) / 2**24  # 24 bits: exact in float32, never 0 or 1


def row_uniform(keys: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`uniform` for a batch of rows: (B, n) from keys (B,) and positions (B,), row r's numbers those
    ``uniform(keys[r], positions[r], n)`` gives."""
    stream = mix32(keys ^ mix32(positions & _MASK))  # (B,)
    ids = torch.arange(n, device=positions.device, dtype=torch.int64)
    bits = mix32((stream[:, None] + ids * _STRIDE) & _MASK)  # (B, n)
    return ((bits >> 8).float() + 0.5) / 2**24


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: the whole vocabulary
    # Choose among ids below this: the tokenizer's vocabulary, when the model has more embedding rows
    # than the tokenizer has ids (Qwen3: 151936 rows, 151669 ids). 0: every logit.
    vocab: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def sample(logits: torch.Tensor, sampling: Sampling, key: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The chosen token id of logits (..., vocab), shaped (..., 1), int64.

    ``position``: where the chosen token will sit in the sequence (the noise's counter).
    Logits from ``sampling.vocab`` on are left out, as if they were -inf (a view, nothing written);
    the noise of the ids kept does not change, so a seed draws the same tokens either way.
    """
    if 0 < sampling.vocab < logits.shape[-1]:
        logits = logits[..., : sampling.vocab]
    if sampling.greedy:
        return logits.argmax(-1, keepdim=True)
    scores = logits.float() / sampling.temperature
    vocab = scores.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    gumbel = -torch.log(-torch.log(uniform(key, position, vocab)))
    return (scores + gumbel).argmax(-1, keepdim=True)

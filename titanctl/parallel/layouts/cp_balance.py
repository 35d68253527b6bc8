"""Load balance of context parallel under masks: each query position's attention work, the order in which
the CP ranks hold the positions (head-tail or chosen from the work), and the imbalance it leaves.

A rank's attention work is the number of (query, key) pairs the masks let its queries attend, summed over
the microbatch's rows and over the softmax-attention layers (a sliding layer's window caps a query's keys;
Gated DeltaNet layers cost the same per token wherever it sits, so they do not count). It is read off the
documents' starts, never off a materialized T x T mask: a query at position p of a document that starts at
s attends p - s + 1 keys (at most ``window`` in a sliding layer).

Head-tail (torch's ring order: 2 x cp chunks, rank r holding chunks r and 2cp-1-r) balances one causal
document exactly, but under a document mask the work sits where the long documents are, wherever that is.
``mask_aware_order`` cuts the sequence into equal chunks and deals them to the ranks by work (largest
first to the least loaded rank that still has room, then swaps between the most and least loaded ranks),
so every rank still holds seq_len / cp positions; it keeps head-tail unless it beats it.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import Tensor

from titanctl.parallel.layouts.context_parallel import load_balanced_order
from titanctl.parallel.layouts.ring_mask import document_start_positions

BALANCERS = ("head_tail", "mask_aware")
TILE = 128  # FlexAttention's block: finer chunks would leave block masks partial tiles on GPUs
MIN_CHUNKS_PER_RANK = 8  # below TILE-sized chunks, cut at least this fine (short sequences)
SWAP_ROUNDS = 64
GOOD_ENOUGH = 1.001  # an imbalance no finer chunking is tried to improve


def attention_work(doc_ids: Tensor | None, seq_len: int, windows: list[int | None]) -> Tensor:
    """(seq_len,) float64: the keys each query position attends, summed over the rows of ``doc_ids`` (B, T)
    (a document id per token, None: one causal document) and over ``windows`` (one per softmax layer: None
    full attention, w a sliding window of w positions)."""
    position = torch.arange(seq_len)
    if doc_ids is None:
        span = (position + 1)[None]  # (1, T)
    else:
        first = document_start_positions(doc_ids.cpu(), seq_len)  # (B, T) where each token's document starts
        span = position - first + 1  # (B, T) keys of the token's document up to itself
    span = span.to(torch.float64)
    layers = Counter(windows)  # layers of one window cost alike
    work = sum((n * (span if w is None else span.clamp(max=w)) for w, n in layers.items()), torch.zeros_like(span))
    return work.sum(dim=0)


def rank_work(work: Tensor, order: Tensor, cp: int) -> Tensor:
    """(cp,) float64: each rank's attention work when the ranks hold ``order`` (rank r: the r-th of cp
    equal slices)."""
    return work[order].view(cp, -1).sum(dim=1)


def imbalance(per_rank: Tensor) -> float:
    """The most loaded rank's work / the mean (1.0: balanced, or no work)."""
    mean = per_rank.mean()
    return 1.0 if mean <= 0 else float(per_rank.max() / mean)


def _deal(chunk_work: Tensor, cp: int) -> tuple[Tensor, float]:
    """(cp, n / cp) the chunks (of ``chunk_work``, n of them) dealt to the ranks, and the imbalance they
    leave: largest first to the least loaded rank with room, then swaps of a chunk of the most loaded rank for
    a lighter one of the least loaded rank, while that lowers the larger of the two."""
    per_rank = len(chunk_work) // cp
    owned: list[list[int]] = [[] for _ in range(cp)]
    load = [0.0] * cp
    for c, w in sorted(enumerate(chunk_work.tolist()), key=lambda cw: -cw[1]):
        r = min((r for r in range(cp) if len(owned[r]) < per_rank), key=lambda r: (load[r], r))
        owned[r].append(c)
        load[r] += w
    dealt = torch.tensor(owned)  # (cp, per_rank)
    for _ in range(SWAP_ROUNDS):
        loads = chunk_work[dealt].sum(dim=1)
        hi, lo = int(loads.argmax()), int(loads.argmin())
        gap = loads[hi] - loads[lo]
        moved = chunk_work[dealt[hi]][:, None] - chunk_work[dealt[lo]][None, :]  # (per_rank, per_rank)
        after = torch.where((moved > 0) & (moved < gap), (gap - 2 * moved).abs(), torch.inf)
        best = int(after.argmin())
        if not torch.isfinite(after.view(-1)[best]):
            break
        i, j = divmod(best, per_rank)
        dealt[hi, i], dealt[lo, j] = dealt[lo, j].clone(), dealt[hi, i].clone()
    return dealt, imbalance(chunk_work[dealt].sum(dim=1))


def _chunk_counts(seq_len: int, cp: int) -> list[int]:
    """The chunkings tried: 2cp chunks (head-tail's), then halved while they divide the sequence and stay a
    TILE long, or until each rank holds MIN_CHUNKS_PER_RANK."""
    counts, n = [], 2 * cp
    while seq_len % n == 0 and (not counts or seq_len // n >= TILE or n <= MIN_CHUNKS_PER_RANK * cp):
        counts.append(n)
        n *= 2
    return counts


def mask_aware_order(work: Tensor, cp: int) -> Tensor:
    """(seq_len,) positions in the order the CP ranks hold them (rank r: the r-th slice of seq_len / cp),
    chosen from ``work`` (``attention_work``): of the chunkings ``_chunk_counts`` allows, the dealt one with
    the least imbalance (the coarsest on ties, and none finer once one is within GOOD_ENOUGH); head-tail
    unless one beats it."""
    seq_len = work.numel()
    prefix = torch.cat([work.new_zeros(1), work.cumsum(dim=0)])  # (T + 1,) one pass serves every chunking

    def chunk_work(n: int) -> Tensor:  # (n,) the work of each of n equal chunks
        edges = prefix[:: seq_len // n]
        return edges[1:] - edges[:-1]

    halves = chunk_work(2 * cp)  # head-tail's chunks: rank r holds r and 2cp-1-r
    best, best_imbalance = None, imbalance(halves[:cp] + halves[cp:].flip(0))
    for n in _chunk_counts(seq_len, cp):
        dealt, got = _deal(chunk_work(n), cp)
        if got < best_imbalance - 1e-9:
            best, best_imbalance = (n, dealt), got
        if best_imbalance <= GOOD_ENOUGH:  # finer chunks would cost more than they could gain
            break
    if best is None:
        return load_balanced_order(seq_len, cp)
    n, dealt = best
    chunks = torch.arange(seq_len).view(n, -1)  # (n, seq_len / n)
    return chunks[dealt.sort(dim=1).values.reshape(-1)].reshape(-1)

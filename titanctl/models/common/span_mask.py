"""A document or sliding-window attention mask kept as what defines it (each position's document start and an
optional window), never as a T x T bool: under it the query at position p attends exactly the keys at positions
``low(p) .. p``, ``low(p) = max(start of p's document, p - window + 1)``.

Documents are contiguous runs of positions (a new one at each BOS, or where chat positions restart), so that one
interval per query is the whole mask. ``low`` never decreases along a row, so a chunk of consecutive queries
``first .. last - 1`` sees only the contiguous keys ``low(first) .. last - 1``: ``span_attention`` attends each
chunk to that span alone, its block of the mask made from the starts when it is attended. Memory: O(B T).

A ``SpanMask`` covers positions 0..T-1 in order for queries and keys (one process, and Ulysses context
parallelism, whose kernels see the whole sequence). Ring context parallelism's ``RingMask`` (a rank's queries
over the ranks' keys, in their order) reads its intervals from the same ``document_start_positions`` and
``first_keys``. It is a pytree node (its starts the leaf), so a pipeline splits it along the batch like a tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from titanctl import _torch_compat


def document_start_positions(doc_ids: Tensor | None, seq_len: int, device=None) -> Tensor:
    """(B, T) int64: the position where each token's document begins, from ``doc_ids`` (B, T) (non-decreasing
    document ids along each row); None: one causal document, (1, T) zeros."""
    if doc_ids is None:
        return torch.zeros(1, seq_len, dtype=torch.long, device=device)
    position = torch.arange(seq_len, device=doc_ids.device)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.where(starts, position, 0).cummax(dim=1).values


def first_keys(starts: Tensor, positions: Tensor, window: int | None) -> Tensor:
    """The first key position each query at ``positions`` attends: its document's start (``starts``, read at
    those positions), or ``window - 1`` before it when that is later."""
    return starts if not window else torch.maximum(starts, positions - window + 1)


def is_fake(t: Tensor) -> bool:
    """Whether ``t`` is estimate-memory's fake tensor: shapes, no values to read."""
    return isinstance(t, _torch_compat.FAKE_TENSOR.get())


class SpanMask:
    """Queries and keys at positions 0..T-1 under documents starting at ``starts`` (B or 1, T) and an optional
    sliding ``window`` (the last ``window`` positions, the query's own included)."""

    def __init__(self, starts: Tensor, window: int | None = None):
        self.starts, self.window = starts, window or None  # (pytree maps may pass any leaf: nothing read here)
        self._spans: dict[int, list[tuple[int, int, int]]] = {}

    @classmethod
    def causal(cls, length: int, window: int | None = None, device=None) -> SpanMask:
        """One document over the whole sequence (causal), narrowed to ``window`` when given."""
        return cls(document_start_positions(None, length, device), window)

    @classmethod
    def of_documents(cls, doc_ids: Tensor, window: int | None = None) -> SpanMask:
        """The block-causal mask of ``doc_ids`` (B, T) (non-decreasing document ids along each row)."""
        return cls(document_start_positions(doc_ids, doc_ids.shape[1]), window)

    def narrowed(self, window: int) -> SpanMask:
        """This mask and a sliding window of ``window`` positions."""
        return SpanMask(self.starts, min(window, self.window) if self.window else window)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The dense mask's: (B or 1, 1, T, T)."""
        return (self.starts.shape[0], 1, self.length, self.length)

    @property
    def length(self) -> int:
        return self.starts.shape[-1]

    def low(self) -> Tensor:
        """(B or 1, T): each query's first key."""
        return first_keys(self.starts, torch.arange(self.length, device=self.starts.device), self.window)

    def spans(self, rows: int) -> list[tuple[int, int, int]]:
        """(first, last, low) per chunk of ``rows`` queries: queries first..last-1 see keys low..last-1 only
        (low: the earliest first key of the chunk's rows over the batch). Read once per chunk size; fake starts
        (estimate-memory) give the causal spans (low 0), the most any tokens can make."""
        if rows not in self._spans:
            firsts = list(range(0, self.length, rows))
            if is_fake(self.starts):
                lows = [0] * len(firsts)
            else:
                lows = self.low()[:, firsts].amin(dim=0).tolist()
            self._spans[rows] = [(f, min(f + rows, self.length), lo) for f, lo in zip(firsts, lows, strict=True)]
        return self._spans[rows]

    def block(self, first: int, last: int, low: int) -> Tensor:
        """(B or 1, 1, last - first, last - low) bool: which keys low..last-1 the queries first..last-1 see."""
        device = self.starts.device
        queries = torch.arange(first, last, device=device)
        keys = torch.arange(low, last, device=device)
        lows = first_keys(self.starts[:, first:last], queries, self.window)  # (B or 1, rows)
        seen = (keys[None, None, :] >= lows[:, :, None]) & (keys[None, None, :] <= queries[None, :, None])
        return seen[:, None]

    def dense(self) -> Tensor:
        """(B or 1, 1, T, T) bool: the whole mask (tests and small references only)."""
        return self.block(0, self.length, 0)

    def document_firsts(self) -> Tensor:
        """(B or 1, T) bool: the positions where a document begins (Gated DeltaNet restarts its state there);
        a window does not cut a document."""
        return self.starts == torch.arange(self.length, device=self.starts.device)


_torch_compat.REGISTER_PYTREE_NODE.get()(
    SpanMask,
    lambda mask: ([mask.starts], mask.window),
    lambda leaves, window: SpanMask(leaves[0], window),
    serialized_type_name="titanctl.models.common.span_mask.SpanMask",
)

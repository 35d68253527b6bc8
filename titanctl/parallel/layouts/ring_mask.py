"""The mask of one CP rank's queries over every rank's keys, kept as what defines it (each position's document
start, a sliding window, the positions in the ranks' order) so that no rank ever holds a (T / cp) x T bool.

Documents are contiguous runs of positions (a new one at each BOS, or where chat positions restart), so under a
document mask, a sliding window or both a query at position p attends exactly the keys at positions
``low(p) .. p``, with ``low(p) = max(start of p's document, p - window + 1)``. That interval per query is the
whole mask: the masked ring (masked_ring.py) makes each (T / cp) x (T / cp) block from it when it attends that
block, and every rank reads the cp x cp table of non-empty blocks off it alone (no collective): rank j's keys
meet rank r's queries when some key of j lies in some query's interval, a count by binary search over j's sorted
positions, O(cp T log T) in all. Memory: O(B T) per rank (the document starts), plus one block at a time.

The Gated DeltaNet scan under CP (linear_attention_cp.py) reads its document boundaries from the same starts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from titanctl import _torch_compat
from titanctl.models.common.span_mask import document_start_positions, first_keys

__all__ = ["RingMask", "document_start_positions"]  # the starts live with SpanMask, the one-sequence mask


class RingMask:
    """This rank's queries (``q_positions``, T / cp of them) over every rank's keys (``kv_positions``, T, rank j's
    the j-th slice) under documents starting at ``starts`` (B or 1, T) and an optional sliding ``window``."""

    def __init__(self, starts: Tensor, q_positions: Tensor, kv_positions: Tensor, cp: int,
                 window: int | None = None):
        device = starts.device
        self.q_positions, self.kv_positions = q_positions.to(device), kv_positions.to(device)
        self.cp, self.window = cp, window
        self.starts = starts
        self.query_starts = starts[:, self.q_positions]  # (B, T / cp): each query's document start
        self.low = self._low(self.query_starts, self.q_positions)  # (B, T / cp): each query's first key
        self.shape = (starts.shape[0], 1, self.q_positions.numel(), self.kv_positions.numel())
        self._table: list[list[bool]] | None = None

    def _low(self, starts: Tensor, positions: Tensor) -> Tensor:
        return first_keys(starts, positions, self.window)

    @property
    def keys_per_rank(self) -> int:
        return self.kv_positions.numel() // self.cp

    def block(self, j: int) -> Tensor:
        """(B or 1, 1, T / cp, T / cp) bool: which of rank j's keys each of this rank's queries sees."""
        n = self.keys_per_rank
        keys = self.kv_positions[j * n:(j + 1) * n][None, None, :]  # (1, 1, n)
        return ((keys >= self.low[:, :, None]) & (keys <= self.q_positions[None, :, None]))[:, None]

    def table(self) -> list[list[bool]]:
        """[r][j]: whether rank r's queries see any key of rank j (read once per mask, every layer reuses it)."""
        if self._table is not None:
            return self._table
        if isinstance(self.starts, _torch_compat.FAKE_TENSOR.get()):  # estimate-memory: no values, every block
            return [[True] * self.cp for _ in range(self.cp)]
        total, n = self.kv_positions.numel(), self.keys_per_rank
        positions = torch.arange(total, device=self.starts.device)
        low = self._low(self.starts, positions)  # (B, T): every query position's first key
        owner = torch.empty_like(positions)
        owner[self.kv_positions] = torch.arange(total, device=positions.device) // n  # position -> its rank
        table = torch.zeros(self.cp, self.cp, dtype=torch.bool)
        for j in range(self.cp):
            keys = self.kv_positions[j * n:(j + 1) * n].sort().values
            seen = torch.searchsorted(keys, positions, right=True) - torch.searchsorted(keys, low)  # (B, T)
            hits = (seen > 0).any(dim=0)  # (T,): whether the query at each position sees a key of rank j
            table[:, j] = torch.zeros(self.cp, device=hits.device).index_add_(0, owner, hits.float()).cpu() > 0
        self._table = table.tolist()
        return self._table

    def sees_back(self, lags: int) -> Tensor:
        """(B or 1, T / cp, lags + 1) bool: whether each query is of the same document as the position ``lag``
        before it (0 .. lags; False before the sequence's start), windows aside."""
        earlier = self.q_positions[:, None] - torch.arange(lags + 1, device=self.q_positions.device)[None, :]
        return earlier[None] >= self.query_starts[:, :, None]

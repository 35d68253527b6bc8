"""Context parallel for layers that read their neighbours through ``sequence_pieces``
(titanctl/models/common/sequence_pieces.py; an attention over a sliding window and compressed entries): a rank's
two head-tail chunks, the rows just before each chunk fetched from their owners, and small per-chunk results
(compressed entries) all-gathered.

Under CP the sequence is cut into 2 x cp chunks and rank r holds chunks r and 2cp-1-r (the head-tail order of
torch's ring and of ``document_context_parallel_ctx``; the step cuts tokens and labels so). Such a layer needs
two things from other ranks:

- The rows before each chunk (a sliding window's keys and values, a compressor's overlapping window): every
  rank all-gathers each chunk's last ``min(rows, chunk)`` rows, 2 x cp x rows of one layer's width, and takes
  the ones before its own chunks in sequence order (a window longer than a chunk reaches several chunks back).
- Per-chunk results every query may read (the compressed entries, S / rate of them): one all-gather of each
  rank's two chunks' rows, put in sequence order.

Both gathers are functional all-gathers whose backward reduce-scatters, so each row's gradient from every rank
that read it returns to its owner, summed: the layer's gradients are one process's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from titanctl import _torch_compat
from titanctl.models.common.sequence_pieces import WholeSequence
from titanctl.parallel.layouts.context_parallel import load_balanced_order


class HeadTailPieces(WholeSequence):
    """This CP rank's share: chunks r and 2cp-1-r of the 2 x cp equal chunks of the sequence."""

    pieces = 2

    def __init__(self, cp_mesh):
        self.mesh = cp_mesh
        self.ranks = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self.chunks = (self.rank, 2 * self.ranks - 1 - self.rank)  # this rank's pieces, in the order it holds them
        gather = (_torch_compat.CP_ALL_GATHER_AUTOGRAD if _torch_compat.torch_at_least("2.13")
                  else _torch_compat.CP_ALL_GATHER_AUTOGRAD_BEFORE_2_13).get()
        self._gather_fn = gather

    def _gather(self, pieces: Tensor) -> Tensor:
        """(2, ...) this rank's pieces -> (2cp, ...) every rank's, rank by rank (autograd-aware)."""
        return self._gather_fn(pieces.contiguous(), 0, self.mesh)

    def _in_sequence_order(self, pieces: Tensor) -> list[Tensor]:
        """Every rank's (2, ...) pieces gathered, as the 2 x cp chunks in sequence order."""
        every = self._gather(pieces)
        cp = self.ranks
        return [every[2 * c if c < cp else 2 * (2 * cp - 1 - c) + 1] for c in range(2 * cp)]

    def total_length(self, length: int) -> int:
        return length * self.ranks

    def positions(self, length: int, device) -> Tensor:
        return load_balanced_order(length * self.ranks, self.ranks).view(self.ranks, -1)[self.rank].to(device)

    def reach(self, rows: int) -> int:
        return rows

    def preceding(self, t: Tensor, rows: int, fill: float = 0.0) -> Tensor:
        batch, length = t.shape[:2]
        n = length // 2
        if rows == 0:
            return t.new_empty(batch, 2, 0, *t.shape[2:])
        tail = min(rows, n)
        tails = t.view(batch, 2, n, *t.shape[2:])[:, :, n - tail:].transpose(0, 1)  # (2, B, tail, ...)
        # the sequence's tails in order after `rows` fill rows: chunk c's `rows` predecessors start at c x tail
        timeline = torch.cat([t.new_full((batch, rows, *t.shape[2:]), fill), *self._in_sequence_order(tails)], dim=1)
        return torch.stack([timeline[:, c * tail: c * tail + rows] for c in self.chunks], dim=1)

    def gather(self, t: Tensor) -> Tensor:
        batch, rows = t.shape[:2]
        pieces = t.view(batch, 2, rows // 2, *t.shape[2:]).transpose(0, 1)  # (2, B, m, ...)
        return torch.cat(self._in_sequence_order(pieces), dim=1)


def holds_sequence_pieces(model: torch.nn.Module) -> bool:
    """Whether ``model`` has layers that read their neighbours through ``sequence_pieces`` (they run context
    parallel by this module, with no masks and no ring)."""
    return any(isinstance(getattr(m, "sequence_pieces", None), WholeSequence) for m in model.modules())


def enable_sequence_pieces(model: torch.nn.Module, cp_mesh) -> None:
    """Give every layer of ``model`` that reads its neighbours through ``sequence_pieces`` this rank's share
    over ``cp_mesh`` (idempotent)."""
    for module in model.modules():
        if type(getattr(module, "sequence_pieces", None)) is WholeSequence:
            module.sequence_pieces = HeadTailPieces(cp_mesh)

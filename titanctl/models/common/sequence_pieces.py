"""The share of the sequence a token-mixing layer holds, as the layer sees it: which pieces of the sequence, at
which positions, the rows just before each piece, and every piece's rows gathered in sequence order.

A layer that reads its neighbours through these four calls (an attention over a sliding window and over
compressed entries that pool fixed windows of tokens) runs unchanged whether it holds the whole sequence or a
context-parallel rank's share of it. One process holds the whole sequence as one piece (``WholeSequence``,
here); under context parallelism titanctl/parallel/layouts/sequence_pieces.py sets the layer's
``sequence_pieces`` to a rank's two head-tail chunks, whose gathers are collectives (the model itself never
holds a process group).
"""

from __future__ import annotations

import torch
from torch import Tensor


class WholeSequence:
    """One piece: the whole sequence, from position 0, in order."""

    pieces = 1  # pieces this process holds, each ``length / pieces`` rows, in the order its rows hold them
    ranks = 1  # processes sharing the sequence

    def total_length(self, length: int) -> int:
        """The whole sequence's length, from this process's ``length`` rows."""
        return length

    def positions(self, length: int, device) -> Tensor:
        """(length,) the position in the sequence of each of this process's rows."""
        return torch.arange(length, device=device)

    def reach(self, rows: int) -> int:
        """How many of the ``rows`` rows before each piece a layer should fetch: none when no piece has any."""
        return 0

    def preceding(self, t: Tensor, rows: int, fill: float = 0.0) -> Tensor:
        """(B, pieces, rows, ...) the ``rows`` rows of the sequence just before each piece of ``t`` (B, length,
        ...); ``fill`` before position 0. Differentiable: the gradient reaches the rows' owners."""
        return t.new_full((t.shape[0], 1, rows, *t.shape[2:]), fill)

    def gather(self, t: Tensor) -> Tensor:
        """(B, pieces x m, ...): every piece's m rows, this process's in its order -> the whole sequence's
        (B, total pieces x m, ...) in sequence order. Differentiable (the gradient goes back to each owner)."""
        return t


WHOLE_SEQUENCE = WholeSequence()

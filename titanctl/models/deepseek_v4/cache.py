"""DeepSeek-V4's decoding caches, allocated once and written at a tensor of positions: per layer, the sliding
window's keys (= values) as a ring of ``sliding_window`` slots, and for a CSA/HCA layer its compressor's state
(and a CSA layer's indexer's): the projections of the tokens of the windows not yet compressed, and the
compressed entries.

Why a ring for the window: a query sees only the last ``sliding_window`` positions, so a cache of every position
(the shared ``KVCache``) would hold, at V4's 1M-token context, 1M x head_dim per layer of keys no query reads
again; the ring holds 128. The compressed entries are what a long context keeps: one per ``rate`` positions.

Every position before a call's first one was written by the same generation (the prompt runs from position 0):
so a ring slot holds the latest of those positions that maps to it, computed from the call's first position, and
a slot written by an earlier, longer generation is never read. An entry is written in the call whose input holds
its window's last token, before that call attends: it is visible from that token on (``visible_entries``), and
the partial windows of a call are pooled but not stored.

Nothing here depends on the number of query heads: the keys are one shared head, the entries and the indexer's
keys one vector per window, so a split of the heads over ranks needs no other cache.
"""

from __future__ import annotations

import torch
from torch import nn


class WindowCache(nn.Module):
    """The last ``window`` positions' keys (B, window, head_dim) in a ring: position p in slot p % window."""

    def __init__(self, batch: int, window: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.window = window
        self.register_buffer("kv", torch.zeros(batch, window, head_dim, dtype=dtype, device=device), persistent=False)

    def update(self, kv: torch.Tensor, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv (B, T, head_dim) at positions input_pos (T,) -> (the keys the queries may see (B, window + T,
        head_dim): the ring's, then these; which each query sees (T, window + T)), and store the last
        ``window`` of kv in the ring."""
        w, t = self.window, kv.shape[1]
        first = input_pos[:1]
        held = first - w + (torch.arange(w, device=kv.device) - first) % w  # the position in each slot (W,)
        key_pos = torch.cat([held, input_pos])
        distance = input_pos[:, None] - key_pos[None, :]
        seen = (key_pos >= 0)[None, :] & (distance >= 0) & (distance < w)
        keys = torch.cat([self.kv, kv], dim=1)
        tail = min(t, w)
        self.kv.index_copy_(1, input_pos[-tail:] % w, kv[:, -tail:])
        return keys, seen


class CompressorCache(nn.Module):
    """A compressor's state: the projections (kv, and gate with its position bias) of the last ``span``
    positions in a ring (``rate`` for HCA's disjoint windows; ``2 x rate`` for CSA's, each entry also pooling
    the window before), and the entries (B, max_seq_len // rate, head_dim), one more row where the windows a
    call pools but does not store go."""

    def __init__(self, batch: int, max_seq_len: int, rate: int, overlap: bool, width: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.rate, self.span = rate, (2 if overlap else 1) * rate
        self.capacity = max_seq_len // rate
        for name in ("kv", "gate"):
            self.register_buffer(name, torch.zeros(batch, self.span, width, dtype=dtype, device=device),
                                 persistent=False)
        self.register_buffer("entries", torch.zeros(batch, self.capacity + 1, head_dim, dtype=dtype, device=device),
                             persistent=False)

    def windows(self, kv: torch.Tensor, gate: torch.Tensor, input_pos: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The whole windows around the new tokens (kv, gate (B, T, width) at input_pos), in position order:
        (kv, gate (B, n x rate, width), each window's index (n,)), from the ring's positions before the call
        (so that an entry's windows are complete) to the call's last window; positions before 0 or after the
        call's last are kv 0 and the gate's lowest value (weight 0 beside any real one). Stores the last
        ``span`` positions' projections in the ring."""
        rate, span, t = self.rate, self.span, kv.shape[1]
        first, last = input_pos[:1], input_pos[-1:]
        # The first window start at or after first - span: (first - span) is first's offset in its window.
        start = first - span + (rate - first % rate) % rate
        n = span // rate + -(-t // rate)  # enough windows to reach the call's last position
        pos = start + torch.arange(n * rate, device=kv.device)
        index = torch.where(pos >= first, span + (pos - first).clamp(max=t - 1), pos % span)
        real = ((pos >= 0) & (pos <= last))[None, :, None]
        window_kv = torch.cat([self.kv, kv], dim=1).index_select(1, index).masked_fill(~real, 0)
        lowest = torch.finfo(gate.dtype).min
        window_gate = torch.cat([self.gate, gate], dim=1).index_select(1, index).masked_fill(~real, lowest)
        tail = min(t, span)
        self.kv.index_copy_(1, input_pos[-tail:] % span, kv[:, -tail:])
        self.gate.index_copy_(1, input_pos[-tail:] % span, gate[:, -tail:])
        return window_kv, window_gate, start // rate + torch.arange(n, device=kv.device)

    def store(self, entries: torch.Tensor, window: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """Write the entries (B, n, head_dim) of the windows (n,) whose last token is in this call; return every
        entry slot (B, max_seq_len // rate, head_dim)."""
        ends = window * self.rate + self.rate - 1
        closed = (ends >= input_pos[:1]) & (ends <= input_pos[-1:])
        self.entries.index_copy_(1, torch.where(closed, window, self.capacity), entries)
        return self.entries[:, : self.capacity]


class LayerCache(nn.Module):
    """One layer's caches: its window, and a CSA/HCA layer's compressor's (None in a sliding layer) and a CSA
    layer's indexer's (else None)."""

    def __init__(self, window: WindowCache, compressor: CompressorCache | None, indexer: CompressorCache | None):
        super().__init__()
        self.window, self.compressor, self.indexer = window, compressor, indexer

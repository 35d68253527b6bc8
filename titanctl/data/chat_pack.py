"""Exact packing: whole conversations into windows of seq_len tokens, none split across two.

Bins are filled first-fit decreasing (longest conversation first, each into the first window with
room), which leaves less than 2/9 of the windows' room empty at worst beyond the optimum; a
segment tree over the windows' free room finds the first that fits in O(log n).

A window is three rows of seq_len int32 (``WINDOW_ROWS``): the input tokens, the labels (the next
token of the same conversation where it is a target, else IGNORE_INDEX), and each token's position
in its conversation, which restarts at 0 where a conversation begins: the boundary that the
attention mask and RoPE read (never a token id: Qwen's end-of-turn is its EOS). The padding after
the last conversation is one more span of positions from 0, with IGNORE_INDEX labels, so it neither
counts in the loss nor is seen by any conversation.
"""

from __future__ import annotations

import numpy as np

IGNORE_INDEX = -100  # a label that no loss counts (titanctl.train.loss, F.cross_entropy's default)
WINDOW_ROWS = 3  # tokens, labels, positions
TOKENS, LABELS, POSITIONS = range(WINDOW_ROWS)


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The window of each item (n,) int64, windows numbered in the order they are opened."""
    n = len(lengths)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if int(lengths.max()) > capacity or int(lengths.min()) < 1:
        raise ValueError(f"item lengths must be in 1..{capacity}")
    size = 1 << max(1, (n - 1).bit_length())  # leaves: at most one window per item
    free = [capacity] * (2 * size)  # a node holds the most room of any window below it
    window = np.empty(n, dtype=np.int64)
    for item in np.argsort(-lengths, kind="stable").tolist():
        need = int(lengths[item])
        node = 1
        while node < size:  # the leftmost leaf with room
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        window[item] = node - size
        free[node] -= need
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return window


def pack_windows(
    conversations: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int
) -> np.ndarray:
    """(ids, targets) of conversations of at most seq_len tokens -> windows (n, WINDOW_ROWS, seq_len) int32."""
    lengths = np.array([len(ids) for ids, _ in conversations], dtype=np.int64)
    placed = first_fit_decreasing(lengths, seq_len)
    n_windows = int(placed.max()) + 1 if len(placed) else 0
    windows = np.empty((n_windows, WINDOW_ROWS, seq_len), dtype=np.int32)
    windows[:, TOKENS] = pad_id
    windows[:, LABELS] = IGNORE_INDEX
    filled = np.zeros(n_windows, dtype=np.int64)
    # Within a window, conversations in the order they were placed (longest first).
    for item in np.argsort(-lengths, kind="stable").tolist():
        ids, targets = conversations[item]
        w, start, length = placed[item], filled[placed[item]], len(ids)
        span = slice(start, start + length)
        windows[w, TOKENS, span] = ids
        labels = np.where(targets[1:], ids[1:], IGNORE_INDEX)  # position t learns token t + 1
        windows[w, LABELS, start : start + length - 1] = labels
        windows[w, POSITIONS, span] = np.arange(length)
        filled[w] += length
    for w in range(n_windows):  # the padding: positions from 0 again
        windows[w, POSITIONS, filled[w]:] = np.arange(seq_len - filled[w])
    return windows


def text_windows_as_rows(windows: np.ndarray, bos_id: int | None) -> np.ndarray:
    """Pre-training windows (n, seq_len + 1) in the chat layout (n, WINDOW_ROWS, seq_len), for a mixture
    of chat and text: every label counts, and positions restart at each BOS (a window's first tokens
    before it are one more document), as ``model.attn_mask_type = block_causal`` reads text."""
    n, width = windows.shape
    out = np.empty((n, WINDOW_ROWS, width - 1), dtype=np.int32)
    out[:, TOKENS] = windows[:, :-1]
    out[:, LABELS] = windows[:, 1:]
    index = np.broadcast_to(np.arange(width - 1), (n, width - 1))
    starts = np.zeros_like(index) if bos_id is None else np.where(out[:, TOKENS] == bos_id, index, 0)
    out[:, POSITIONS] = index - np.maximum.accumulate(starts, axis=1)
    return out

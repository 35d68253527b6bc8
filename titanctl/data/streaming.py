"""Streaming datasets (c4, hf:) packed into windows whose order does not depend on the layout.

A stream is split into N virtual shards (training.stream_shards; 0 takes one per file of the
dataset): shard v is ``split_dataset_by_node(dataset, rank=v, world_size=N)``, its documents
tokenized as BOS doc EOS BOS doc EOS ... and cut into windows of seq_len + 1 tokens. A global
sample i that draws from the stream takes the next window of shard i mod N. Which window a
sample gets therefore depends only on i and the samples before it, never on the layout.

Data-parallel rank r of degree d trains on the samples i with i mod d == r (dataloader.py), so
its samples come from the shards v with v mod g == r mod g, g = gcd(N, d). A rank keeps every
one of those shards at the global position: it packs all windows drawn from them, its own and
those of the other ranks reading the same shard, and keeps its own. A shard's state (the
stream position plus the tokens pulled but not yet handed out) is then the same on every rank
that reads it, and the ranks together hold all N shards: a run resumes under any DP degree,
each rank loading the shards it reads now.

Costs at scale:
- When d divides N, each shard is read by exactly one rank: nothing is read twice. Otherwise
  d / g ranks read and tokenize each shard (at worst, g = 1, every rank reads everything).
  Choose N as a multiple of every DP degree the run may use (c4's 1024 files suit up to 1024).
- A rank holds one open reader per shard it reads, N / g of them (all N at DP 1) — file handles
  or HTTP streams — and each shard's leftover tokens, which go into the checkpoint as plain data
  (< _STREAM_CHUNK_DOCS documents per shard).
- N that does not divide the dataset's number of files makes `datasets` split by rows: each
  shard's reader then reads every row and keeps 1 in N (N times the reading, no extra tokenizing).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from titanctl.data.datasets import HFStreamingSource
from titanctl.data.tokenizer import Tokenizer
from titanctl.errors import DataError
from titanctl.safe_io import visible

_STREAM_CHUNK_DOCS = 16  # documents pulled from a shard per refill: bounds the leftover tokens it saves


class ShardedStream:
    """One streaming source as seen by one data-parallel rank: the virtual shards it reads."""

    def __init__(
        self, source: HFStreamingSource, tokenizer: Tokenizer, seq_len: int, n_shards: int,
        dp_rank: int, dp_degree: int,
    ) -> None:
        self.source = source
        self.n_shards = n_shards or source.num_shards
        self.window = seq_len + 1
        shared = math.gcd(self.n_shards, dp_degree)
        self.shards = {
            v: _Shard(source, tokenizer, self.window, v, self.n_shards)
            for v in range(self.n_shards)
            if v % shared == dp_rank % shared
        }

    def take(self, sample_ids: np.ndarray, mine: np.ndarray) -> np.ndarray:
        """The windows of one step's samples that draw from this stream.

        sample_ids (n,) ascending global sample ids; mine (n,) bool, this rank's samples among them.
        Returns (mine.sum(), seq_len + 1): the windows of this rank's samples, in order.
        """
        shard_of = sample_ids % self.n_shards
        out = np.empty((int(mine.sum()), self.window), dtype=np.int32)
        slot = np.cumsum(mine) - 1  # index into out of each of this rank's samples
        for v in np.unique(shard_of).tolist():
            if v not in self.shards:  # other ranks' shard: none of this rank's samples come from it
                continue
            here = shard_of == v
            windows = self.shards[v].take(int(here.sum()))  # (samples of shard v, seq_len + 1)
            keep = mine[here]
            out[slot[here][keep]] = windows[keep]
        return out

    def state_dict(self) -> dict[str, str]:
        """``shard{v}``: one JSON string per shard this rank reads (the same on every rank reading it)."""
        return {f"shard{v}": shard.state() for v, shard in self.shards.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for v, shard in self.shards.items():
            key = f"shard{v}"
            if key not in state:
                raise DataError(
                    f"streaming loader state of {self.source.description} has no {key}; it was saved with "
                    f"another number of virtual shards than {self.n_shards} (training.stream_shards)"
                )
            shard.load(state[key])


class _Shard:
    """Virtual shard ``index`` of ``count``: its documents packed into windows, read on demand."""

    def __init__(self, source: HFStreamingSource, tokenizer: Tokenizer, window: int, index: int, count: int):
        self.source, self.tokenizer, self.window = source, tokenizer, window
        self.index, self.count = index, count
        self.dataset: Any = None  # opened on first use: a rank may read many shards
        self._rows: Iterator[dict] | None = None
        self._resume: dict | None = None  # a restored stream position, until reading starts
        self.buffer = np.empty(0, dtype=np.int32)  # tokens pulled but not yet handed out

    def take(self, n: int) -> np.ndarray:
        needed = n * self.window
        while len(self.buffer) < needed:
            self._refill()
        out = self.buffer[:needed].reshape(n, self.window)  # (n, seq_len + 1)
        self.buffer = self.buffer[needed:]
        return out

    def _refill(self) -> None:
        if self._rows is None:
            self._rows = iter(self._open())
        texts = []
        try:
            for row in self._rows:
                text = self.source.text_of(row)
                if text:
                    texts.append(text)
                if len(texts) == _STREAM_CHUNK_DOCS:
                    break
        except DataError:
            raise
        except Exception as e:  # raised in datasets or pyarrow by what a file holds (hub files are not checked first)
            raise DataError(
                f"cannot read streaming dataset {self.source.description} (virtual shard {self.index} of "
                f"{self.count}): {_one_line(e)}"
            ) from None
        if not texts:
            raise DataError(
                f"streaming dataset {self.source.description} ran out of documents "
                f"(virtual shard {self.index} of {self.count})"
            )
        pieces = [np.asarray(ids, dtype=np.int32) for ids in self.tokenizer.encode_batch(texts, bos=True, eos=True)]
        self.buffer = np.concatenate([self.buffer, *pieces])

    def _open(self) -> Any:
        from datasets.distributed import split_dataset_by_node  # streams come from `datasets` only

        dataset = self.source.dataset
        if self.count > 1:
            dataset = split_dataset_by_node(dataset, rank=self.index, world_size=self.count)
        if self._resume is not None:
            dataset.load_state_dict(self._resume)
        self.dataset = dataset
        return dataset

    def state(self) -> str:
        # The stream position is after every document pulled so far; the tokens of those
        # documents not yet handed out travel in the buffer.
        stream = self.dataset.state_dict() if self._rows is not None else self._resume
        return json.dumps({"stream": stream, "buffer": self.buffer.tolist()})

    def load(self, text: Any) -> None:
        try:
            state = json.loads(text)
            stream, buffer = state["stream"], np.asarray(state["buffer"], dtype=np.int32)
        except (TypeError, ValueError, KeyError) as e:
            raise DataError(f"streaming loader state of shard {self.index} is damaged: {e}") from None
        if buffer.ndim != 1 or (stream is not None and not isinstance(stream, dict)):
            raise DataError(f"streaming loader state of shard {self.index} is damaged")
        self._resume, self.buffer = stream, buffer
        self.dataset, self._rows = None, None  # reopen at the restored position


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return visible(f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__)

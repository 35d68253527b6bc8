"""Checkpointable token loader whose global batches do not depend on the parallel layout.

Sources: one dataset, or a mixture of weighted ones (training.datasets), each finite (bundled,
local files) or streaming (c4, hf:).

Global sample i: step s consumes global samples [s*G, (s+1)*G) for G = global_batch_size.
Sample i draws from source c(i), a seeded hash of (seed, i) spread over the weights
(mixture.py; always the one source without a mixture), and takes that source's next window:
- finite sources: every document is tokenized as BOS + text + EOS, all documents are
  concatenated into one flat token array, and the array is cut into non-overlapping windows of
  seq_len + 1 tokens (the tail that does not fill a window is dropped). The k-th sample drawn
  from the source is window perm_e[k % n_windows] of epoch e = k // n_windows, where perm_e is
  a permutation drawn from a private generator seeded by (seed, e) (in a mixture by
  (seed, source number, e));
- streaming sources: the next window of virtual shard i mod N (streaming.py);
- chat sources (chat.py): the same as finite sources, over windows of whole conversations packed once.
  With a chat source every microbatch is (inputs, labels, positions): labels hold IGNORE_INDEX where
  nothing is learned, and positions restart at 0 where a conversation (or, for a text source in the
  same mixture, a document) begins.

Ranks: data-parallel rank r of degree d trains on the step's samples i with i mod d == r, in
order, and its microbatch m holds the m-th local_batch_size of them. So the union over ranks of
a step is the same G samples for every DP degree, local batch size and gradient accumulation.

State: the samples consumed and, for a mixture, the samples drawn from each source so far:
the same on every rank and layout. Streaming sources add the position of each virtual shard
that the rank reads (the same on every rank reading it; all ranks together hold all shards). A
run can resume under any DP degree, local batch size or gradient accumulation and continue with
exactly the next samples.

Tokenized finite sources are cached as .npy files under ~/.cache/titanctl (override
with TITANCTL_CACHE_DIR; set it to the empty string to disable the cache), keyed by the
tokenizer's sha256 and the source's content fingerprint.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titanctl.data.cache import cache_dir
from titanctl.data.chat import ChatSource
from titanctl.data.chat_pack import LABELS, POSITIONS, TOKENS, WINDOW_ROWS, text_windows_as_rows
from titanctl.data.datasets import DocumentSource
from titanctl.data.mixture import MixtureSampler, WeightedSource, label_of
from titanctl.data.streaming import ShardedStream
from titanctl.data.tokenizer import Tokenizer
from titanctl.errors import DataError, counted

_ENCODE_CHUNK_DOCS = 256  # documents per encode_batch call: enough to keep threads busy
_CACHE_FORMAT = "titanctl-tokens-v1"  # bump when the packing of documents changes

# (inputs, labels), or with chat data (inputs, labels, positions); each (local_batch_size, seq_len) int64
Microbatch = tuple[torch.Tensor, ...]


class TokenWindowLoader:
    def __init__(
        self,
        sources: DocumentSource | ChatSource | Sequence[WeightedSource],
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        global_batch_size: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        seed: int,
        stream_shards: int = 0,
    ) -> None:
        _require_int("training.seq_len", seq_len, 1)
        _require_int("training.local_batch_size", local_batch_size, 1)
        _require_int("data-parallel degree", dp_degree, 1)
        _require_int("training.seed", seed, 0)
        _require_int("training.stream_shards", stream_shards, 0)
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_degree:
            raise DataError(f"data-parallel rank {dp_rank!r} is out of range; valid: 0..{dp_degree - 1}")
        per_microbatch = local_batch_size * dp_degree
        if (
            not isinstance(global_batch_size, int)
            or global_batch_size < per_microbatch
            or global_batch_size % per_microbatch
        ):
            raise DataError(
                f"training.global_batch_size={global_batch_size!r} must be a positive multiple of "
                f"local_batch_size x data-parallel degree = "
                f"{local_batch_size} x {dp_degree} = {per_microbatch}"
            )
        if isinstance(sources, (DocumentSource, ChatSource)):
            sources = [WeightedSource(label_of(sources), sources)]
        self.sources = list(sources)
        if not self.sources:
            raise DataError("no dataset to read: training.datasets is empty")
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.seed = seed
        self.samples_consumed = 0  # global samples (sequences) handed out over all ranks
        self.drawn = [0] * len(self.sources)  # global samples drawn from each source
        mixed = len(self.sources) > 1
        self._sampler = MixtureSampler([s.weight for s in self.sources], seed) if mixed else None
        self._readers: list[_ShuffledWindows | ShardedStream] = []
        # Chat data: every window in the (tokens, labels, positions) layout, text windows converted.
        self.chat = any(getattr(entry.source, "chat", False) for entry in self.sources)
        self.bos_id = tokenizer.bos_id
        self.notes: list[str] = []  # what the trainer says at start (what became of chat rows)
        chat_templates = []
        for j, entry in enumerate(self.sources):
            source = entry.source
            if getattr(source, "chat", False):
                key = (seed, j + 1) if mixed else (seed,)
                windows = _ShuffledWindows.of(source.windows(tokenizer, seq_len), key)
                self.notes.append(source.report.summary())
                chat_templates.append(source.template_sha256)
                needed = 1 if mixed else global_batch_size
                if windows.n_windows < needed:
                    raise DataError(
                        f"chat dataset {source.description} packs into {counted(windows.n_windows, 'window')} of "
                        f"seq_len={seq_len}, "
                        + (f"fewer than one global batch of {global_batch_size}; " if not mixed else "")
                        + "lower training.global_batch_size, or add data"
                    )
                self._readers.append(windows)
                continue
            if source.streaming:
                self._readers.append(
                    ShardedStream(source, tokenizer, seq_len, stream_shards, dp_rank, dp_degree)
                )
                continue
            key = (seed, j + 1) if mixed else (seed,)  # a mixture's sources shuffle independently
            windows = _ShuffledWindows(tokenize_finite(source, tokenizer), seq_len, key)
            # One source feeds whole global batches; in a mixture one window is enough to cycle.
            needed = 1 if mixed else global_batch_size
            if windows.n_windows < needed:
                raise DataError(
                    f"dataset {source.description} has {counted(windows.n_tokens, 'token')} = "
                    f"{counted(windows.n_windows, 'window')} of seq_len+1={seq_len + 1}, "
                    + (f"fewer than one global batch of {global_batch_size}; " if not mixed else "not one; ")
                    + "lower training.seq_len or training.global_batch_size, or add data"
                )
            self._readers.append(windows)
        self.fingerprint = {
            "dataset": " + ".join(
                (f"{s.weight:g} x " if mixed else "") + f"{s.source.name}:{s.source.fingerprint}"
                for s in self.sources
            ),
            "tokenizer": tokenizer.sha256,
            "seq_len": seq_len,
            "seed": seed,
        }
        streams = [r for r in self._readers if isinstance(r, ShardedStream)]
        if streams:
            self.fingerprint["stream_shards"] = ",".join(str(r.n_shards) for r in streams)
        if chat_templates:
            self.fingerprint["chat_template"] = ",".join(chat_templates)

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.local_batch_size * self.dp_degree)

    @property
    def n_windows(self) -> int | None:
        """Windows per epoch of a single finite source; None for a stream or a mixture."""
        (reader, *others) = self._readers
        return reader.n_windows if isinstance(reader, _ShuffledWindows) and not others else None

    def tokens_by_source(self) -> dict[str, int]:
        """Tokens trained on from each source so far, over all ranks (seq_len per sample)."""
        return {s.label: n * self.seq_len for s, n in zip(self.sources, self.drawn)}

    def next_step(self) -> list[Microbatch]:
        """This rank's grad_accum_steps microbatches of the next optimizer step."""
        ids = np.arange(self.samples_consumed, self.samples_consumed + self.global_batch_size, dtype=np.int64)
        which = self._sampler.choose(ids) if self._sampler else np.zeros(len(ids), dtype=np.int64)
        mine = ids % self.dp_degree == self.dp_rank
        slot = np.cumsum(mine) - 1  # each of this rank's samples' row in `windows`
        shape = (WINDOW_ROWS, self.seq_len) if self.chat else (self.seq_len + 1,)
        windows = np.empty((int(mine.sum()), *shape), dtype=np.int32)
        for j, reader in enumerate(self._readers):
            here = which == j
            n = int(here.sum())
            if not n:
                continue
            keep = mine[here]
            if isinstance(reader, ShardedStream):
                taken = reader.take(ids[here], keep)
            else:
                draws = self.drawn[j] + np.arange(n)  # the k-th, (k+1)-th, ... sample from source j
                taken = reader.take(draws[keep])
            if self.chat and taken.ndim == 2:  # a text source in a chat mixture
                taken = text_windows_as_rows(taken, self.bos_id)
            windows[slot[here][keep]] = taken
            self.drawn[j] += n
        self.samples_consumed += self.global_batch_size
        batch = torch.from_numpy(windows).to(torch.int64)  # (G / dp, seq_len + 1) or (G / dp, 3, seq_len)
        if self.chat:
            return [
                (rows[:, TOKENS].contiguous(), rows[:, LABELS].contiguous(), rows[:, POSITIONS].contiguous())
                for rows in batch.split(self.local_batch_size)
            ]
        # Next-token prediction: labels are the inputs shifted left by one.
        return [
            (rows[:, :-1].contiguous(), rows[:, 1:].contiguous()) for rows in batch.split(self.local_batch_size)
        ]

    def state_dict(self) -> dict[str, Any]:
        """Layout-independent, except that streams hold the shards this rank reads (see streaming.py)."""
        state: dict[str, Any] = {
            "samples_consumed": self.samples_consumed,
            "fingerprint": dict(self.fingerprint),
        }
        if len(self.sources) > 1:
            state["drawn"] = list(self.drawn)
        streams = {
            f"source{j}": reader.state_dict()
            for j, reader in enumerate(self._readers)
            if isinstance(reader, ShardedStream)
        }
        if streams:
            state["streams"] = streams
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("fingerprint", {})
        diffs = [
            f"{key} {saved.get(key)!r} in the checkpoint vs {now!r} now"
            for key, now in self.fingerprint.items()
            if saved.get(key) != now
        ]
        if diffs:
            raise DataError("data loader state is from a different data setup: " + "; ".join(diffs))
        consumed = int(state["samples_consumed"])
        drawn = [int(n) for n in state["drawn"]] if len(self.sources) > 1 else [consumed]
        if len(drawn) != len(self.sources) or sum(drawn) != consumed:
            raise DataError(f"data loader state draws {drawn} from the sources but consumed {consumed} samples")
        for j, reader in enumerate(self._readers):
            if isinstance(reader, ShardedStream):
                reader.load_state_dict(state["streams"][f"source{j}"])
        self.samples_consumed, self.drawn = consumed, drawn


class _ShuffledWindows:
    """Windows of a flat token array (or given windows), visited in a fresh permutation each epoch."""

    def __init__(self, tokens: np.ndarray, seq_len: int, key: tuple[int, ...]) -> None:
        self.n_tokens = len(tokens)
        self.n_windows = len(tokens) // (seq_len + 1)
        # (n_tokens,) -> (n_windows, seq_len + 1); a view, the tail is dropped
        self.windows = tokens[: self.n_windows * (seq_len + 1)].reshape(self.n_windows, seq_len + 1)
        self.key = key
        self._perms: dict[int, np.ndarray] = {}

    @classmethod
    def of(cls, windows: np.ndarray, key: tuple[int, ...]) -> _ShuffledWindows:
        """Over whole windows already cut (chat: (n, WINDOW_ROWS, seq_len))."""
        self = cls.__new__(cls)
        self.windows, self.n_windows, self.n_tokens = windows, len(windows), windows[:, TOKENS].size
        self.key, self._perms = key, {}
        return self

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:  # a step spans at most two epochs of a source that fills it; keep memory flat
                self._perms.clear()
            # A private generator: nothing else that draws random numbers can shift it.
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([*self.key, epoch])))
            self._perms[epoch] = rng.permutation(self.n_windows)
        return self._perms[epoch]

    def take(self, draws: np.ndarray) -> np.ndarray:
        """Draw numbers (n,) -> their windows (n, seq_len + 1)."""
        epochs, positions = np.divmod(draws, self.n_windows)
        window_ids = np.empty_like(draws)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            window_ids[here] = self.permutation(int(epoch))[positions[here]]
        return self.windows[window_ids]


def tokenize_finite(source: DocumentSource, tokenizer: Tokenizer) -> np.ndarray:
    """All documents of a finite source as one flat int32 array of BOS doc EOS BOS doc EOS ..."""
    cache_file = _cache_file(source, tokenizer)
    if cache_file is not None and cache_file.is_file():
        try:
            # Memory-mapped: ranks on one machine share the page cache instead of each
            # holding its own copy of the token array.
            return np.load(cache_file, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError):  # truncated or foreign file: rebuild it
            pass
    if tokenizer.vocab_size > np.iinfo(np.int32).max:
        raise DataError(f"tokenizer vocab_size {tokenizer.vocab_size} does not fit int32 token arrays")
    pieces: list[np.ndarray] = []
    chunk: list[str] = []
    for text in source:
        if text:  # an empty document would only add a BOS EOS pair
            chunk.append(text)
        if len(chunk) == _ENCODE_CHUNK_DOCS:
            pieces.extend(
                np.asarray(ids, dtype=np.int32) for ids in tokenizer.encode_batch(chunk, bos=True, eos=True)
            )
            chunk = []
    if chunk:
        pieces.extend(
            np.asarray(ids, dtype=np.int32) for ids in tokenizer.encode_batch(chunk, bos=True, eos=True)
        )
    if not pieces:
        raise DataError(f"dataset {source.description} contains no non-empty documents")
    tokens = np.concatenate(pieces)
    if cache_file is not None:
        _write_atomically(cache_file, tokens)
    return tokens


def _cache_file(source: DocumentSource, tokenizer: Tokenizer) -> Path | None:
    root = cache_dir()
    if root is None:
        return None
    key = hashlib.sha256(f"{_CACHE_FORMAT}:{tokenizer.sha256}:{source.fingerprint}".encode()).hexdigest()
    return root / "tokens" / f"{source.name}-{key[:32]}.npy"


def _write_atomically(path: Path, tokens: np.ndarray) -> None:
    """Write via a temporary file and rename, so concurrent ranks never read half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, tokens, allow_pickle=False)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass  # a read-only cache only costs re-tokenizing next time


def _require_int(what: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise DataError(f"{what}={value!r} is invalid; expected an integer >= {minimum}")

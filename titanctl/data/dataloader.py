"""Checkpointable token loader whose global batches do not depend on the parallel layout.

Finite sources (bundled, local): every document is tokenized as BOS + text + EOS, all
documents are concatenated into one flat token array, and the array is cut into
non-overlapping windows of seq_len + 1 tokens (the tail that does not fill a window is
dropped). Global sample i is window perm_e[i % n_windows] of epoch e = i // n_windows,
where perm_e is a permutation drawn from a private generator seeded by (seed, e).

Step s consumes global samples [s*G, (s+1)*G) for G = global_batch_size. Microbatch m
of data-parallel rank r holds samples s*G + m*(dp*lb) + r*lb + j for j < lb. So the
union over ranks of a step is the same G samples for every DP degree, and the only
state is how many global samples were consumed: a run can resume under any DP degree,
local batch size or gradient accumulation and continue with exactly the next samples.

Streaming sources (c4) are sharded by rank with `datasets.distributed.split_dataset_by_node`
and packed on the fly; their state is per rank (the stream position plus leftover
tokens) and must be restored with the same DP degree. Layout invariance holds only for
finite sources.

Tokenized finite sources are cached as .npy files under ~/.cache/titanctl (override
with TITANCTL_CACHE_DIR; set it to the empty string to disable the cache), keyed by the
tokenizer's sha256 and the source's content fingerprint.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titanctl.data.datasets import DocumentSource
from titanctl.data.tokenizer import Tokenizer
from titanctl.errors import DataError

_ENCODE_CHUNK_DOCS = 256  # documents per encode_batch call: enough to keep threads busy
_STREAM_CHUNK_DOCS = 64  # documents pulled from a stream per refill
_CACHE_FORMAT = "titanctl-tokens-v1"  # bump when the packing of documents changes

Microbatch = tuple[torch.Tensor, torch.Tensor]  # (inputs, labels), each (local_batch_size, seq_len) int64


class TokenWindowLoader:
    def __init__(
        self,
        source: DocumentSource,
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        global_batch_size: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        seed: int,
    ) -> None:
        _require_int("training.seq_len", seq_len, 1)
        _require_int("training.local_batch_size", local_batch_size, 1)
        _require_int("data-parallel degree", dp_degree, 1)
        _require_int("training.seed", seed, 0)
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
        self.source = source
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.seed = seed
        self.samples_consumed = 0  # global samples (sequences) handed out over all ranks
        self.fingerprint = {
            "dataset": f"{source.name}:{source.fingerprint}",
            "tokenizer": tokenizer.sha256,
            "seq_len": seq_len,
            "seed": seed,
        }
        if source.streaming:
            self._stream: _StreamPacker | None = _StreamPacker(source, tokenizer, seq_len, dp_rank, dp_degree)
            self._windows: _ShuffledWindows | None = None
        else:
            self._stream = None
            self._windows = _ShuffledWindows(tokenize_finite(source, tokenizer), seq_len, seed)
            if self._windows.n_windows < global_batch_size:
                raise DataError(
                    f"dataset {source.description} has {self._windows.n_tokens} tokens = "
                    f"{self._windows.n_windows} windows of seq_len+1={seq_len + 1}, "
                    f"fewer than one global batch of {global_batch_size}; "
                    "lower training.seq_len or training.global_batch_size, or add data"
                )

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.local_batch_size * self.dp_degree)

    @property
    def n_windows(self) -> int | None:
        """Windows per epoch of a finite source; None when streaming."""
        return self._windows.n_windows if self._windows else None

    def next_step(self) -> list[Microbatch]:
        """This rank's grad_accum_steps microbatches of the next optimizer step."""
        lb, per_microbatch = self.local_batch_size, self.local_batch_size * self.dp_degree
        microbatches = []
        for m in range(self.grad_accum_steps):
            if self._windows is not None:
                first = self.samples_consumed + m * per_microbatch + self.dp_rank * lb
                windows = self._windows.take(np.arange(first, first + lb))
            else:
                windows = self._stream.take(lb)
            batch = torch.from_numpy(windows).to(torch.int64)  # (lb, seq_len + 1)
            # Next-token prediction: labels are the inputs shifted left by one.
            microbatches.append((batch[:, :-1].contiguous(), batch[:, 1:].contiguous()))
        self.samples_consumed += self.global_batch_size
        return microbatches

    def state_dict(self) -> dict[str, Any]:
        """Finite sources: DP-degree independent. Streaming: this rank's stream position."""
        state: dict[str, Any] = {
            "samples_consumed": self.samples_consumed,
            "fingerprint": dict(self.fingerprint),
        }
        if self._stream is not None:
            state.update(self._stream.state_dict())
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
        if self._stream is not None:
            self._stream.load_state_dict(state)
        self.samples_consumed = int(state["samples_consumed"])


class _ShuffledWindows:
    """Windows of a flat token array, visited in a fresh permutation each epoch."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int) -> None:
        self.n_tokens = len(tokens)
        self.n_windows = len(tokens) // (seq_len + 1)
        # (n_tokens,) -> (n_windows, seq_len + 1); a view, the tail is dropped
        self.windows = tokens[: self.n_windows * (seq_len + 1)].reshape(self.n_windows, seq_len + 1)
        self.seed = seed
        self._perms: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:  # a step spans at most two epochs; keep memory flat
                self._perms.clear()
            # A private generator: nothing else that draws random numbers can shift it.
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            self._perms[epoch] = rng.permutation(self.n_windows)
        return self._perms[epoch]

    def take(self, sample_ids: np.ndarray) -> np.ndarray:
        """Global sample ids (n,) -> their windows (n, seq_len + 1)."""
        epochs, positions = np.divmod(sample_ids, self.n_windows)
        window_ids = np.empty_like(sample_ids)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            window_ids[here] = self.permutation(int(epoch))[positions[here]]
        return self.windows[window_ids]


class _StreamPacker:
    """Packs this rank's shard of a streaming source into windows as they are needed."""

    def __init__(
        self, source: DocumentSource, tokenizer: Tokenizer, seq_len: int, dp_rank: int, dp_degree: int
    ) -> None:
        from datasets.distributed import split_dataset_by_node  # streams come from `datasets` only

        self.source = source
        self.tokenizer = tokenizer
        self.window = seq_len + 1
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.dataset = split_dataset_by_node(source.dataset, rank=dp_rank, world_size=dp_degree)
        self._rows: Iterator[dict] | None = None
        self._buffer: list[int] = []  # tokens of pulled documents not yet handed out

    def take(self, n: int) -> np.ndarray:
        needed = n * self.window
        while len(self._buffer) < needed:
            self._refill()
        out = np.asarray(self._buffer[:needed], dtype=np.int32).reshape(n, self.window)  # (n, seq_len + 1)
        del self._buffer[:needed]
        return out

    def _refill(self) -> None:
        if self._rows is None:
            self._rows = iter(self.dataset)
        texts = []
        for row in self._rows:
            text = row[self.source.text_field]
            if text:
                texts.append(text)
            if len(texts) == _STREAM_CHUNK_DOCS:
                break
        if not texts:
            raise DataError(
                f"streaming dataset {self.source.description} ran out of documents on rank {self.dp_rank}"
            )
        for ids in self.tokenizer.encode_batch(texts, bos=True, eos=True):
            self._buffer.extend(ids)

    def state_dict(self) -> dict[str, Any]:
        # The stream position is after every document pulled so far; the tokens of those
        # documents that were not yet handed out travel in the buffer.
        return {
            "dp_rank": self.dp_rank,
            "dp_degree": self.dp_degree,
            "stream": self.dataset.state_dict(),
            "buffer": list(self._buffer),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state.get("dp_rank"), state.get("dp_degree")) != (self.dp_rank, self.dp_degree):
            raise DataError(
                f"streaming loader state was saved by rank {state.get('dp_rank')} of data-parallel degree "
                f"{state.get('dp_degree')}, but this is rank {self.dp_rank} of {self.dp_degree}; a streaming "
                "dataset resumes only with the same data-parallel degree"
            )
        self.dataset.load_state_dict(state["stream"])
        self._rows = None  # restart iteration from the restored position
        self._buffer = list(state["buffer"])


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


def cache_dir() -> Path | None:
    """Where tokenized datasets are cached; None when TITANCTL_CACHE_DIR is set but empty."""
    env = os.environ.get("TITANCTL_CACHE_DIR")
    if env is not None:
        return Path(env).expanduser() if env else None
    return Path.home() / ".cache" / "titanctl"


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

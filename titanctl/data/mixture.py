"""Data mixtures: which source each global sample draws from.

Global sample i draws from source c(i) = the interval of the cumulative normalized weights that
u(i) falls in, where u(i) in [0, 1) is a hash of (seed, i) (splitmix64, vectorized over numpy
uint64 arrays). c is a pure function of (seed, weights, i): no generator state to carry, the same
on every rank and layout, and any sample's source can be computed without the ones before it.
Over n samples source j gets n * w_j / sum(w) of them, within binomial noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from titanctl.config.job_config import SFT, Training
from titanctl.data.chat import CHAT_PREFIX, ChatSource, is_chat
from titanctl.data.datasets import DocumentSource, load_documents
from titanctl.errors import DataError


@dataclass
class WeightedSource:
    label: str  # how metrics name it: the dataset name, or the path for local files
    source: DocumentSource | ChatSource
    weight: float = 1.0


def label_of(source: DocumentSource | ChatSource) -> str:
    return source.description if source.name in ("local", "chat") else source.name


def chat_source(name: str, sft: SFT, split: str = "train") -> ChatSource:
    """A ``chat:...`` dataset name with the [sft] settings that turn its rows into windows."""
    return ChatSource(name[len(CHAT_PREFIX):], split=split, train_on=sft.train_on, overlong=sft.overlong,
                      chat_template_path=sft.chat_template_path)


def sources_from_config(training: Training, sft: SFT | None = None) -> list[WeightedSource]:
    """training.datasets when given, else the one training.dataset / dataset_path."""
    sft = sft if sft is not None else SFT()
    if not training.datasets:
        if is_chat(training.dataset):
            if training.dataset_path:
                raise DataError(f"dataset {training.dataset!r} takes no dataset_path; the file goes after chat:")
            source = chat_source(training.dataset, sft)
        else:
            source = load_documents(training.dataset, training.dataset_path or None)
        return [WeightedSource(label_of(source), source)]
    mixture = []
    for n, entry in enumerate(training.datasets):
        if entry.name == "local":
            raise DataError(f"training.datasets[{n}]: give local files as path = FILE_OR_FOLDER, not name = 'local'")
        if entry.path:
            source = load_documents("local", entry.path)
        elif is_chat(entry.name):
            source = chat_source(entry.name, sft, entry.split)
        else:
            source = load_documents(entry.name, config=entry.config, split=entry.split, text_field=entry.text_field)
        mixture.append(WeightedSource(entry.label, source, float(entry.weight)))
    return mixture


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mix of each element (uint64 arithmetic wraps modulo 2^64)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class MixtureSampler:
    def __init__(self, weights: Sequence[float], seed: int) -> None:
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or len(w) == 0 or not np.all(np.isfinite(w)) or not np.all(w > 0):
            raise DataError(f"mixture weights {list(weights)!r} must be finite and > 0")
        self.cumulative = np.cumsum(w) / w.sum()
        self.cumulative[-1] = 1.0  # rounding must not leave a gap below 1
        # The seed enters through its own mix, so seeds s and s+1 do not give shifted sequences.
        self._key = _splitmix64(np.array([seed], dtype=np.uint64))

    def choose(self, sample_ids: np.ndarray) -> np.ndarray:
        """Global sample ids (n,) -> the index of the source each draws from (n,)."""
        bits = _splitmix64(np.asarray(sample_ids).astype(np.uint64) ^ self._key)
        u = (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53  # uniform in [0, 1), 53 bits
        return np.searchsorted(self.cumulative, u, side="right")

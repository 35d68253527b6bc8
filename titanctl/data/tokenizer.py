"""Llama 3 tokenizer: tiktoken byte-level BPE from a `tokenizer.model` ranks file.

The file format is Meta's: one `base64(token_bytes) rank` line per token. Llama 3.1's
256 special tokens are appended after the base ranks, so Meta's own file gives the
usual ids (128000 = <|begin_of_text|>) and the bundled 4096-rank tokenizer gives
4096 = <|begin_of_text|>. This module does not import torch.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
from collections.abc import Sequence
from pathlib import Path

from titanctl.errors import DataError

DEFAULT_TOKENIZER_PATH = Path(__file__).resolve().parent.parent / "assets" / "tokenizer" / "tokenizer.model"

# Llama 3's pre-tokenizer split: contractions, letter runs, 1-3 digit groups,
# punctuation runs, newlines and other whitespace.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

NUM_SPECIAL_TOKENS = 256
# Llama 3.1's named special tokens in id order (offsets 0..10 after the base ranks);
# checked against meta-llama/llama-models' 3.1 tokenizer and the HF Llama-3.1 configs.
_NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",  # end of message
    "<|eot_id|>",  # end of turn
    "<|python_tag|>",
)
# The rest are reserved_special_token_3 .. reserved_special_token_247 (offsets 11..255).
SPECIAL_TOKENS: tuple[str, ...] = _NAMED_SPECIAL_TOKENS + tuple(
    f"<|reserved_special_token_{i}|>" for i in range(3, 3 + NUM_SPECIAL_TOKENS - len(_NAMED_SPECIAL_TOKENS))
)


# tiktoken's regex engine overflows its stack (a Rust panic, not an exception) on very
# long runs of whitespace or of non-whitespace; inputs are cut inside such runs first.
MAX_RUN_CHARS = 25_000
_LONG_RUN = re.compile(rf"\s{{{MAX_RUN_CHARS + 1},}}|\S{{{MAX_RUN_CHARS + 1},}}")


def _split_long_runs(text: str) -> list[str]:
    """Cut `text` so no piece holds a whitespace or non-whitespace run over MAX_RUN_CHARS."""
    if len(text) <= MAX_RUN_CHARS:  # the common case: nothing to search
        return [text]
    cuts = [
        cut
        for run in _LONG_RUN.finditer(text)
        for cut in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS)
    ]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def _encode_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


class Tokenizer:
    """Encode text to Llama 3 token ids and back.

    Special-token text inside the input ("<|eot_id|>") is always encoded as ordinary
    text: only `bos`/`eos` put special ids into the output, so data can never inject
    control tokens.
    """

    def __init__(self, path: str | os.PathLike = DEFAULT_TOKENIZER_PATH) -> None:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        self.path = Path(path)
        try:
            data = self.path.read_bytes()
        except OSError as e:
            raise DataError(
                f"cannot read tokenizer file {self.path} ({e.strerror or e}); give a Llama 3 "
                "tiktoken tokenizer.model, or leave model.tokenizer_path empty for the bundled one"
            ) from None
        # The content hash identifies the tokenizer (the loader keys its caches and
        # checkpoint fingerprints by it). Passing it to tiktoken also defeats its cache
        # keyed by path, which would otherwise return stale ranks after the file changes.
        self.sha256 = hashlib.sha256(data).hexdigest()
        try:
            ranks = load_tiktoken_bpe(str(self.path), expected_hash=self.sha256)
        except ValueError as e:  # a line that is not 'base64 rank', or a hash mismatch
            raise DataError(
                f"tokenizer file {self.path} is not a tiktoken ranks file: {_first_line(e)}"
            ) from None
        _validate_ranks(ranks, self.path)

        self.n_base_tokens = len(ranks)
        self.special_tokens: dict[str, int] = {
            tok: self.n_base_tokens + i for i, tok in enumerate(SPECIAL_TOKENS)
        }
        # tiktoken does not check this itself: a special id equal to an ordinary rank
        # would silently decode to the wrong bytes.
        if set(self.special_tokens.values()) & set(ranks.values()):
            raise DataError(f"tokenizer file {self.path}: special-token ids collide with ordinary ranks")
        self.vocab_size: int = self.n_base_tokens + len(SPECIAL_TOKENS)
        self._model = tiktoken.Encoding(
            name=f"titanctl-{self.sha256[:12]}",
            pat_str=LLAMA3_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
            explicit_n_vocab=self.vocab_size,
        )
        self.bos_id: int = self.special_tokens["<|begin_of_text|>"]
        self.eos_id: int = self.special_tokens["<|end_of_text|>"]
        self.pad_id: int = self.special_tokens["<|finetune_right_pad_id|>"]
        self.eot_id: int = self.special_tokens["<|eot_id|>"]
        self.eom_id: int = self.special_tokens["<|eom_id|>"]
        # Generation stops at any of these: end of text, end of turn, end of message.
        self.stop_tokens: set[int] = {self.eos_id, self.eot_id, self.eom_id}

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = [i for piece in _split_long_runs(text) for i in self._model.encode_ordinary(piece)]
        return self._wrap(ids, bos, eos)

    def encode_batch(self, texts: Sequence[str], *, bos: bool, eos: bool) -> list[list[int]]:
        """Encode many texts on tiktoken's thread pool (its Rust core releases the GIL)."""
        split = [_split_long_runs(t) for t in texts]
        pieces = [piece for parts in split for piece in parts]
        encoded = iter(self._model.encode_ordinary_batch(pieces, num_threads=_encode_threads()))
        out = []
        for parts in split:
            ids = next(encoded) if len(parts) == 1 else [i for _ in parts for i in next(encoded)]
            out.append(self._wrap(ids, bos, eos))
        return out

    def decode(self, ids: Sequence[int]) -> str:
        # Invalid UTF-8 (a sequence cut mid-character) decodes to U+FFFD, never raises.
        return self._model.decode(list(ids))

    def _wrap(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, sha256={self.sha256[:12]})"


def _validate_ranks(ranks: dict[bytes, int], path: Path) -> None:
    if not ranks:
        raise DataError(f"tokenizer file {path} is empty: expected 'base64(token) rank' lines")
    values = sorted(ranks.values())
    if values != list(range(len(values))):
        first_bad = next(i for i, v in enumerate(values) if v != i)
        raise DataError(
            f"tokenizer file {path}: ranks must be 0..{len(values) - 1} without gaps or repeats, "
            f"but rank {first_bad} is missing or repeated"
        )
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        # Byte-level BPE must be able to spell any byte on its own.
        raise DataError(
            f"tokenizer file {path}: single byte 0x{missing[0]:02x} has no rank ({len(missing)} missing)"
        )


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__

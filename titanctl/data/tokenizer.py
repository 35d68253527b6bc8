"""Llama 3 tokenizer: tiktoken byte-level BPE from a `tokenizer.model` ranks file.

The file format is Meta's: one `base64(token_bytes) rank` line per token. Llama 3.1's
256 special tokens are appended after the base ranks, so Meta's own file gives the
usual ids (128000 = <|begin_of_text|>) and the bundled 4096-rank tokenizer gives
4096 = <|begin_of_text|>. This module does not import torch.

A Hugging Face `tokenizer.json` of a byte-level BPE (what Llama 3 repositories ship
beside `original/tokenizer.model`) is read too: its vocab, written in GPT-2's
printable-byte alphabet, maps back to raw bytes and token ids become tiktoken ranks;
its pre-tokenizer regex and added special tokens are used as they are. tiktoken merges
the lowest-ranked pair first and `tokenizers` the earliest merge, so the merges must
come in token-id order, as in tokenizers converted from tiktoken (Llama 3's) and those
trained by `tokenizers` (ids are given in merge order); that is checked. The
`tokenizers` library itself is not needed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
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


# GPT-2's pre-tokenizer split, what a `ByteLevel(use_regex=true)` pre-tokenizer applies.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


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
        # tiktoken (Rust) loads when a tokenizer is built, not when titanctl.data is imported
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
        specials: dict[str, int] | None = None
        pattern = LLAMA3_PATTERN
        if data.lstrip()[:1] == b"{":  # a Hugging Face tokenizer.json
            ranks, specials, pattern = _read_tokenizer_json(data, self.path)
        else:
            try:
                ranks = load_tiktoken_bpe(str(self.path), expected_hash=self.sha256)
            except ValueError as e:  # a line that is not 'base64 rank', or a hash mismatch
                raise DataError(
                    f"tokenizer file {self.path} is not a tiktoken ranks file: {_first_line(e)}"
                ) from None
        _validate_ranks(ranks, self.path)

        self.n_base_tokens = len(ranks)
        self.ranks: dict[bytes, int] = ranks  # the BPE: token bytes -> rank (= id)
        self.pattern: str = pattern  # the pre-tokenizer split regex
        self.special_tokens: dict[str, int] = specials or {
            tok: self.n_base_tokens + i for i, tok in enumerate(SPECIAL_TOKENS)
        }
        # tiktoken does not check this itself: a special id equal to an ordinary rank
        # would silently decode to the wrong bytes.
        if set(self.special_tokens.values()) & set(ranks.values()):
            raise DataError(f"tokenizer file {self.path}: special-token ids collide with ordinary ranks")
        self.vocab_size: int = self.n_base_tokens + len(SPECIAL_TOKENS)
        try:
            self._model = tiktoken.Encoding(
                name=f"titanctl-{self.sha256[:12]}",
                pat_str=pattern,
                mergeable_ranks=ranks,
                special_tokens=self.special_tokens,
                explicit_n_vocab=self.vocab_size,
            )
        except ValueError as e:  # e.g. a tokenizer.json regex tiktoken's engine cannot compile
            raise DataError(f"tokenizer file {self.path} cannot be used by tiktoken: {_first_line(e)}") from None
        self.bos_id: int = self._special_id("<|begin_of_text|>")
        self.eos_id: int = self._special_id("<|end_of_text|>")
        self.pad_id: int = self._special_id("<|finetune_right_pad_id|>")
        self.eot_id: int = self._special_id("<|eot_id|>")
        self.eom_id: int = self._special_id("<|eom_id|>")
        # Generation stops at any of these: end of text, end of turn, end of message.
        self.stop_tokens: set[int] = {self.eos_id, self.eot_id, self.eom_id}

    def _special_id(self, name: str) -> int:
        # A Llama 3.0 tokenizer.json names some ids differently (no <|finetune_right_pad_id|>):
        # the id keeps its Llama 3.1 position.
        return self.special_tokens.get(name, self.n_base_tokens + SPECIAL_TOKENS.index(name))

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


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character of each byte -> the byte (byte-level BPE vocabularies)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # '!'..'~', '¡'..'¬', '®'..'ÿ'
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


def _pre_tokenizer_pattern(pre: object, path: Path) -> str:
    """The single split regex of a byte-level pre-tokenizer (what tiktoken calls pat_str)."""
    if not isinstance(pre, dict):
        raise DataError(f"tokenizer file {path} has no pre-tokenizer: not a byte-level BPE tokenizer")
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    pattern, byte_level = None, False
    for step in steps:
        kind = step.get("type")
        if kind == "Split":
            regex = (step.get("pattern") or {}).get("Regex")
            if regex is None or step.get("invert") or step.get("behavior", "Isolated") != "Isolated" or pattern:
                raise DataError(f"tokenizer file {path}: unsupported Split pre-tokenizer {json.dumps(step)[:120]}")
            pattern = regex
        elif kind == "ByteLevel":
            if step.get("add_prefix_space"):
                raise DataError(f"tokenizer file {path}: ByteLevel add_prefix_space=true is not supported")
            byte_level = True
            if step.get("use_regex", True):
                if pattern:
                    raise DataError(f"tokenizer file {path}: two pre-tokenizer regexes cannot be one tiktoken pattern")
                pattern = GPT2_PATTERN
        else:
            raise DataError(f"tokenizer file {path}: unsupported pre-tokenizer {kind!r}")
    if not byte_level or pattern is None:
        raise DataError(f"tokenizer file {path}: pre-tokenizer is not byte-level BPE (no ByteLevel step)")
    return pattern


def _read_tokenizer_json(data: bytes, path: Path) -> tuple[dict[bytes, int], dict[str, int] | None, str]:
    """(tiktoken ranks, special tokens or None, split regex) of a HF byte-level BPE tokenizer.json."""
    try:
        spec = json.loads(data)
    except ValueError as e:
        raise DataError(f"tokenizer file {path} is not valid JSON: {_first_line(e)}") from None
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or model.get("type", "BPE") != "BPE":
        kind = model.get("type") if isinstance(model, dict) else None
        raise DataError(f"tokenizer file {path}: model type {kind!r} is not byte-level BPE")
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        raise DataError(f"tokenizer file {path}: model has no vocab/merges")
    if model.get("byte_fallback") or spec.get("normalizer"):
        raise DataError(f"tokenizer file {path}: byte_fallback/normalizer (SentencePiece style) is not byte-level BPE")
    pattern = _pre_tokenizer_pattern(spec.get("pre_tokenizer"), path)

    added = {t["content"]: int(t["id"]) for t in spec.get("added_tokens") or []}
    alphabet = _gpt2_byte_alphabet()
    ranks: dict[bytes, int] = {}
    for token, rank in vocab.items():
        if token in added and added[token] == rank:
            continue  # some files list the special tokens in the vocab too
        try:
            ranks[bytes(alphabet[c] for c in token)] = int(rank)
        except KeyError:
            raise DataError(
                f"tokenizer file {path}: token {token!r} is not in the byte-level alphabet"
            ) from None
    # tiktoken merges the pair whose result has the lowest rank: equal to the merge list
    # only if results come in rank order.
    last = -1
    for i, merge in enumerate(merges):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        made = vocab.get(left + right)
        if made is None or made < last:
            raise DataError(
                f"tokenizer file {path}: merge {i} ({left!r} + {right!r}) is out of token-id order; "
                "its merges cannot be expressed as tiktoken ranks"
            )
        last = made

    specials = None
    if added:
        n_base = len(ranks)
        ids = sorted(added.values())
        if ids != list(range(n_base, n_base + NUM_SPECIAL_TOKENS)):
            raise DataError(
                f"tokenizer file {path}: expected Llama 3's {NUM_SPECIAL_TOKENS} special tokens at ids "
                f"{n_base}..{n_base + NUM_SPECIAL_TOKENS - 1}, found {len(ids)} added tokens at {ids[0]}..{ids[-1]}"
            )
        if added.get("<|begin_of_text|>") != n_base or added.get("<|end_of_text|>") != n_base + 1:
            raise DataError(
                f"tokenizer file {path}: <|begin_of_text|>/<|end_of_text|> are not the first special tokens"
            )
        specials = added
    return ranks, specials, pattern


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__

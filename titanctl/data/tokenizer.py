"""Llama 3 tokenizer: tiktoken byte-level BPE from a `tokenizer.model` ranks file.

The file format is Meta's: one `base64(token_bytes) rank` line per token. Llama 3.1's
256 special tokens are appended after the base ranks, so Meta's own file gives the
usual ids (128000 = <|begin_of_text|>) and the bundled 4096-rank tokenizer gives
4096 = <|begin_of_text|>. This module does not import torch.

A Hugging Face `tokenizer.json` of a byte-level BPE (what Llama 3 repositories ship
beside `original/tokenizer.model`, and Qwen's) is read too: its vocab, written in GPT-2's
printable-byte alphabet, maps back to raw bytes and token ids become tiktoken ranks;
its pre-tokenizer regex, NFC normalizer (Qwen's) and added special tokens are used as
they are. tiktoken merges the lowest-ranked pair first and `tokenizers` the earliest
merge, so the merges must come in token-id order, as in tokenizers converted from
tiktoken (Llama 3's, Qwen's) and those trained by `tokenizers` (ids are given in merge
order); that is checked. The `tokenizers` library itself is not needed.

Special tokens: a tokenizer.json whose added tokens are Llama 3's gets Llama 3's (and so
does one without added tokens); any other needs the `tokenizer_config.json` that Hugging
Face repositories keep beside it, which names its bos, eos and pad tokens. Qwen's has no
BOS: `bos_id` is None and `encode(..., bos=True)` adds nothing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import itertools
import os
import re
import unicodedata
from collections.abc import Sequence
from pathlib import Path

from titanctl.errors import DataError
from titanctl.safe_io import parse_json, read_bytes

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


LLAMA_BOS = SPECIAL_TOKENS[0]  # a tokenizer.json that adds it has Llama 3's special tokens
# Qwen's chat tokens: the end of a document and of a turn, where generation stops.
CHAT_END_OF_TEXT, CHAT_END_OF_TURN = "<|endoftext|>", "<|im_end|>"

# What Hugging Face repositories keep beside tokenizer.json; it names the bos/eos/pad tokens.
TOKENIZER_CONFIG = "tokenizer_config.json"
MAX_TOKENIZER_CONFIG_BYTES = 4 << 20  # Qwen3's is 10 kB, Llama 3's 50 kB

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
    """Encode text to token ids (Llama 3's, or a Hugging Face byte-level BPE's) and back.

    Special-token text inside the input ("<|eot_id|>", "<|im_start|>") is always encoded
    as ordinary text: only `bos`/`eos` put special ids into the output, so data can never
    inject control tokens. (`tokenizers` would match added tokens in the text instead.)
    """

    def __init__(self, path: str | os.PathLike = DEFAULT_TOKENIZER_PATH) -> None:
        # tiktoken (Rust) loads when a tokenizer is built, not when titanctl.data is imported
        import tiktoken

        self.path = _file_of_folder(Path(path))
        data = _read_tokenizer_file(self.path)
        specials: dict[str, int] | None = None
        pattern = LLAMA3_PATTERN
        self.nfc = False  # Qwen's tokenizer.json normalizes text to NFC first
        self.config_bytes: bytes | None = None  # the tokenizer_config.json that named the special tokens
        self.is_json = data.lstrip()[:1] in (b"{", b"[")  # a Hugging Face tokenizer.json (base64 has no brackets)
        config = None
        if self.is_json:
            ranks, added, pattern, self.nfc = _read_tokenizer_json(data, self.path)
            config_path = self.path.parent / TOKENIZER_CONFIG
            if added and LLAMA_BOS not in added and os.path.lexists(config_path):
                self.config_bytes = read_bytes(
                    config_path, what="tokenizer config", max_bytes=MAX_TOKENIZER_CONFIG_BYTES, error=DataError
                )
                config = _read_tokenizer_config(self.config_bytes, config_path)
                specials = _following_specials(added, len(ranks), self.path)
            elif added:
                specials = _llama_specials(added, len(ranks), self.path)
        else:
            ranks = _read_tiktoken_ranks(data, self.path)
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
        if config is None:
            self._take_llama_specials()
        else:
            self._take_config_specials(config, config_path)
        # The content hash identifies the tokenizer (the loader keys its caches and checkpoint
        # fingerprints by it): the ids a tokenizer_config.json chose change every encoding.
        self.file_sha256 = hashlib.sha256(data).hexdigest()
        self.sha256 = self.file_sha256 if config is None else hashlib.sha256(
            data + f"\0bos={self.bos_id},eos={self.eos_id}".encode()
        ).hexdigest()
        try:
            self._model = tiktoken.Encoding(
                name=f"titanctl-{self.sha256[:12]}",
                pat_str=pattern,
                mergeable_ranks=ranks,
                special_tokens=self.special_tokens,
                explicit_n_vocab=self.vocab_size,
            )
        except ValueError:  # a tokenizer.json regex tiktoken's engine cannot compile (its message quotes it)
            raise DataError(f"tokenizer file {self.path}: tiktoken cannot compile its pre-tokenizer regex") from None

    def _take_llama_specials(self) -> None:
        self.vocab_size: int = self.n_base_tokens + len(SPECIAL_TOKENS)
        self.bos_id: int | None = self._special_id("<|begin_of_text|>")
        self.eos_id: int = self._special_id("<|end_of_text|>")
        self.pad_id: int | None = self._special_id("<|finetune_right_pad_id|>")
        self.eot_id: int | None = self._special_id("<|eot_id|>")
        self.eom_id: int | None = self._special_id("<|eom_id|>")
        # Generation stops at any of these: end of text, end of turn, end of message.
        self.stop_tokens: set[int] = {self.eos_id, self.eot_id, self.eom_id}

    def _take_config_specials(self, config: dict, config_path: Path) -> None:
        # The added tokens follow the base ranks without gaps (checked), so this is the highest id + 1.
        self.vocab_size = self.n_base_tokens + len(self.special_tokens)
        self.bos_id, self.eos_id, self.pad_id = (
            _config_token(config, field, self.special_tokens, config_path, self.path)
            for field in ("bos_token", "eos_token", "pad_token")
        )
        if self.eos_id is None:
            raise DataError(
                f"tokenizer config {config_path}: eos_token is null or missing; titanctl ends every document with it"
            )
        self.eot_id = self.special_tokens.get(CHAT_END_OF_TURN)
        self.eom_id = None
        # A chat model's config names its end of turn as eos: generation stops at the end of text too.
        self.stop_tokens = {self.eos_id} | {
            self.special_tokens[t] for t in (CHAT_END_OF_TEXT, CHAT_END_OF_TURN) if t in self.special_tokens
        }

    def _special_id(self, name: str) -> int:
        # A Llama 3.0 tokenizer.json names some ids differently (no <|finetune_right_pad_id|>):
        # the id keeps its Llama 3.1 position.
        return self.special_tokens.get(name, self.n_base_tokens + SPECIAL_TOKENS.index(name))

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        ids = [i for piece in _split_long_runs(text) for i in self._model.encode_ordinary(piece)]
        return self._wrap(ids, bos, eos)

    def encode_batch(self, texts: Sequence[str], *, bos: bool, eos: bool) -> list[list[int]]:
        """Encode many texts on tiktoken's thread pool (its Rust core releases the GIL)."""
        if self.nfc:
            texts = [unicodedata.normalize("NFC", t) for t in texts]
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
        if bos and self.bos_id is not None:
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
    if pre is None:
        raise DataError(f"tokenizer file {path} has no pre-tokenizer: not a byte-level BPE tokenizer")
    pre = _typed(pre, dict, "pre_tokenizer", path)
    if pre.get("type") == "Sequence":
        listed = _typed(pre.get("pretokenizers", _MISSING), list, "pre_tokenizer.pretokenizers", path)
        steps = [(f"pre_tokenizer.pretokenizers[{i}]", step) for i, step in enumerate(listed)]
    else:
        steps = [("pre_tokenizer", pre)]
    pattern, byte_level = None, False
    for where, step in steps:
        step = _typed(step, dict, where, path)
        kind = step.get("type")
        if kind == "Split":
            regex = _typed(step.get("pattern", _MISSING), dict, f"{where}.pattern", path).get("Regex")
            if regex is not None:
                _typed(regex, str, f"{where}.pattern.Regex", path)
            if regex is None or step.get("invert") or step.get("behavior", "Isolated") != "Isolated" or pattern:
                raise DataError(
                    f"tokenizer file {path}: {where} is a Split tiktoken cannot do (it needs a single Split by "
                    "a Regex, behavior Isolated, not inverted)"
                )
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
            raise DataError(f"tokenizer file {path}: {where} is of a type titanctl does not read (Split, ByteLevel)")
    if not byte_level or pattern is None:
        raise DataError(f"tokenizer file {path}: pre-tokenizer is not byte-level BPE (no ByteLevel step)")
    return pattern


def _read_tokenizer_json(data: bytes, path: Path) -> tuple[dict[bytes, int], dict[str, int], str, bool]:
    """(tiktoken ranks, added tokens, split regex, whether text is NFC-normalized first) of a HF
    byte-level BPE tokenizer.json.

    Every value is checked for type before use, and no message quotes one: a tokenizer path can
    name any file, and what the file says must not reach the console."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"tokenizer file {path} is not UTF-8 text (byte {e.start})") from None
    spec = _typed(parse_json(text, what=f"tokenizer file {path}", error=DataError), dict, "the file", path)
    model = _typed(spec.get("model", _MISSING), dict, "model", path)
    if model.get("type", "BPE") != "BPE":
        raise DataError(f"tokenizer file {path}: model.type is not BPE, so this is not byte-level BPE")
    vocab = _typed(model.get("vocab", _MISSING), dict, "model.vocab", path)
    merges = _typed(model.get("merges", _MISSING), list, "model.merges", path)
    normalizer = spec.get("normalizer")
    nfc = normalizer == {"type": "NFC"}  # Qwen's
    if model.get("byte_fallback") or (normalizer and not nfc):
        raise DataError(
            f"tokenizer file {path}: byte_fallback/a normalizer other than NFC (SentencePiece style) is not "
            "byte-level BPE"
        )
    pattern = _pre_tokenizer_pattern(spec.get("pre_tokenizer"), path)
    added = _added_tokens(spec.get("added_tokens") or [], path)

    alphabet = _gpt2_byte_alphabet()
    ranks: dict[bytes, int] = {}
    for i, (token, rank) in enumerate(vocab.items()):
        _rank(rank, f"model.vocab entry {i}", path)
        if token in added and added[token] == rank:
            continue  # some files list the special tokens in the vocab too
        try:
            ranks[bytes(alphabet[c] for c in token)] = rank
        except KeyError:
            raise DataError(
                f"tokenizer file {path}: model.vocab entry {i} is not spelled in the byte-level alphabet"
            ) from None
    # tiktoken merges the pair whose result has the lowest rank: equal to the merge list
    # only if results come in rank order.
    last = -1
    for i, merge in enumerate(merges):
        left, right = _merge_pair(merge, i, path)
        made = vocab.get(left + right)
        if made is None:
            raise DataError(f"tokenizer file {path}: merge {i} makes a token that model.vocab lacks")
        if made < last:
            raise DataError(
                f"tokenizer file {path}: merge {i} is out of token-id order; its merges cannot be expressed as "
                "tiktoken ranks"
            )
        last = made
    return ranks, added, pattern, nfc


def _llama_specials(added: dict[str, int], n_base: int, path: Path) -> dict[str, int]:
    """A tokenizer.json's added tokens, checked to be Llama 3's 256 right after the base ranks."""
    ids = sorted(added.values())
    if ids != list(range(n_base, n_base + NUM_SPECIAL_TOKENS)):
        hint = "" if LLAMA_BOS in added else f"; other tokenizers need their {TOKENIZER_CONFIG} beside it"
        raise DataError(
            f"tokenizer file {path}: expected Llama 3's {NUM_SPECIAL_TOKENS} special tokens at ids "
            f"{n_base}..{n_base + NUM_SPECIAL_TOKENS - 1}, found {len(ids)} added tokens at {ids[0]}..{ids[-1]}{hint}"
        )
    if added.get("<|begin_of_text|>") != n_base or added.get("<|end_of_text|>") != n_base + 1:
        raise DataError(
            f"tokenizer file {path}: <|begin_of_text|>/<|end_of_text|> are not the first special tokens"
        )
    return added


def _following_specials(added: dict[str, int], n_base: int, path: Path) -> dict[str, int]:
    """A tokenizer.json's added tokens, checked to take the ids right after the base ranks: every id
    below the vocabulary size then decodes."""
    ids = sorted(added.values())
    if ids != list(range(n_base, n_base + len(ids))):
        raise DataError(
            f"tokenizer file {path}: its {len(ids)} added tokens must take ids {n_base}..{n_base + len(ids) - 1} "
            f"right after the base vocabulary, but take {ids[0]}..{ids[-1]}"
            + (" with repeats" if len(set(ids)) < len(ids) else "")
        )
    return added


def _read_tokenizer_config(data: bytes, path: Path) -> dict:
    """The fields of a tokenizer_config.json, as an object (see _config_token for the ones read)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"tokenizer config {path} is not UTF-8 text (byte {e.start})") from None
    return _typed(parse_json(text, what=f"tokenizer config {path}", error=DataError), dict, "the file", path)


def _config_token(config: dict, field: str, specials: dict[str, int], path: Path, json_path: Path) -> int | None:
    """The id of the token a tokenizer_config.json names in `field` (None when null or missing)."""
    value = config.get(field)
    if isinstance(value, dict):  # older files write an AddedToken object
        value = _typed(value.get("content", _MISSING), str, f"{field}.content", path)
    if value is None:
        return None
    if _typed(value, str, field, path) not in specials:
        raise DataError(f"tokenizer config {path}: {field} is not one of the added tokens of {json_path}")
    return specials[value]


def _added_tokens(listed: object, path: Path) -> dict[str, int]:
    """{content: id} of a tokenizer.json's ``added_tokens``."""
    added: dict[str, int] = {}
    for i, token in enumerate(_typed(listed, list, "added_tokens", path)):
        where = f"added_tokens[{i}]"
        token = _typed(token, dict, where, path)
        content = _typed(token.get("content", _MISSING), str, f"{where}.content", path)
        added[content] = _rank(token.get("id", _MISSING), f"{where}.id", path)
    return added


def _merge_pair(merge: object, i: int, path: Path) -> tuple[str, str]:
    """A merge as its two tokens: ``"left right"`` or ``["left", "right"]``."""
    pair = merge.split(" ") if isinstance(merge, str) else merge
    if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) and t for t in pair)):
        raise DataError(f"tokenizer file {path}: merge {i} is not two tokens ('left right' or [left, right])")
    return pair[0], pair[1]


MAX_RANK = 2**31 - 1  # tiktoken keeps ranks in 32 bits

# What the JSON holds where something else belongs: said by kind, never by value.
_MISSING = object()
_KINDS = ((bool, "true or false"), (int, "an integer"), (float, "a number"), (str, "a string"), (list, "a list"),
          (dict, "an object"))


def _kind(value: object) -> str:
    if value is _MISSING:
        return "missing"
    if value is None:
        return "null"
    return next(name for kind, name in _KINDS if isinstance(value, kind))


def _typed(value: object, kind: type, where: str, path: Path):
    """`value` if it is a `kind` (true and false are not integers); else a DataError saying what it is."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        expected = next(name for k, name in _KINDS if k is kind)
        raise DataError(f"tokenizer file {path}: {where} is {_kind(value)}, expected {expected}")
    return value


def _rank(value: object, where: str, path: Path) -> int:
    if not 0 <= _typed(value, int, where, path) <= MAX_RANK:
        raise DataError(f"tokenizer file {path}: {where} is outside 0..{MAX_RANK}")
    return value


# One line of Meta's tiktoken file: `base64(token) rank`, the rank in ASCII digits.
_TIKTOKEN_RANK = re.compile(rb"[0-9]{1,10}")
# Meta's Llama 3 tokenizer.model is 2.2 MB, Llama 3's tokenizer.json 9 MB, Qwen's 11 MB.
MAX_TOKENIZER_BYTES = 64 << 20


def _file_of_folder(path: Path) -> Path:
    """A Hugging Face tokenizer folder stands for its tokenizer.json (or a tiktoken tokenizer.model)."""
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (path / name).is_file():
                return path / name
    return path


def _read_tokenizer_file(path: Path) -> bytes:
    """The bytes of a tokenizer file: a regular file (no FIFO, device or /proc file) of bounded size."""
    try:
        return read_bytes(path, what="tokenizer file", max_bytes=MAX_TOKENIZER_BYTES, error=DataError)
    except DataError as e:
        raise DataError(
            f"{e}; give a Llama 3 tiktoken tokenizer.model or a byte-level BPE tokenizer.json, or leave "
            "model.tokenizer_path empty for the bundled one"
        ) from None


def _read_tiktoken_ranks(data: bytes, path: Path) -> dict[bytes, int]:
    """{token bytes: rank} of a tiktoken ranks file. tiktoken's own loader is not used: its errors
    quote the offending line, which may be any file's secret."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2 or not _TIKTOKEN_RANK.fullmatch(fields[1]):
            raise DataError(
                f"tokenizer file {path} is not a tiktoken ranks file: line {number} is not 'base64(token) rank' "
                "with the rank a non-negative integer"
            )
        try:
            token = base64.b64decode(fields[0], validate=True)
        except binascii.Error:
            raise DataError(
                f"tokenizer file {path} is not a tiktoken ranks file: the token of line {number} is not base64"
            ) from None
        ranks[token] = int(fields[1])
    return ranks

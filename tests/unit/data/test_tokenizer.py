"""The Llama 3 tiktoken tokenizer, its shipped ranks file and the script that trains it."""

from __future__ import annotations

import base64
import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, LLAMA3_PATTERN, SPECIAL_TOKENS, Tokenizer
from titanctl.errors import DataError

REPO = Path(__file__).resolve().parents[3]
VAL_CORPUS = REPO / "titanctl" / "assets" / "corpus" / "val.jsonl.gz"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def val_docs() -> list[str]:
    with gzip.open(VAL_CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def write_ranks(path: Path, tokens: list[bytes]) -> Path:
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % rank for rank, t in enumerate(tokens)))
    return path


def byte_tokens() -> list[bytes]:
    return [bytes([b]) for b in range(256)]


def test_default_path_is_the_shipped_file():
    assert DEFAULT_TOKENIZER_PATH.is_file()
    assert DEFAULT_TOKENIZER_PATH.parts[-3:] == ("assets", "tokenizer", "tokenizer.model")


def test_shipped_file_has_4096_contiguous_ranks_in_llama3_format():
    lines = DEFAULT_TOKENIZER_PATH.read_bytes().splitlines()
    assert len(lines) == 4096
    tokens = []
    for rank, line in enumerate(lines):
        token_b64, rank_text = line.split(b" ")
        assert int(rank_text) == rank
        tokens.append(base64.b64decode(token_b64, validate=True))
    assert tokens[:256] == byte_tokens()  # single bytes first, rank = byte value
    assert len(set(tokens)) == 4096


def test_vocab_size_and_llama31_special_token_order(tok):
    assert tok.n_base_tokens == 4096
    assert tok.vocab_size == 4096 + 256
    names = [name for name, _ in sorted(tok.special_tokens.items(), key=lambda kv: kv[1])]
    assert names[:11] == [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|reserved_special_token_2|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    assert names[11:] == [f"<|reserved_special_token_{i}|>" for i in range(3, 248)]
    assert list(SPECIAL_TOKENS) == names
    assert sorted(tok.special_tokens.values()) == list(range(4096, 4352))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (4096, 4097, 4100)
    assert tok.stop_tokens == {4097, 4104, 4105}  # end_of_text, eom, eot


def test_meta_sized_file_gives_meta_special_ids(tmp_path):
    # 128000 base ranks like Meta's tokenizer.model: the special ids must be Llama 3.1's.
    extra = [bytes([a, b]) for a in range(256) for b in range(256)]
    extra += [bytes([a, b, 0]) for a in range(256) for b in range(256)]
    tokens = (byte_tokens() + extra)[:128000]
    t = Tokenizer(write_ranks(tmp_path / "tokenizer.model", tokens))
    assert t.vocab_size == 128256
    assert t.bos_id == 128000 and t.eos_id == 128001 and t.pad_id == 128004
    assert t.special_tokens["<|eot_id|>"] == 128009
    assert t.special_tokens["<|reserved_special_token_247|>"] == 128255


def test_round_trip_on_corpus_text(tok, val_docs):
    for doc in val_docs[:20]:
        ids = tok.encode(doc, bos=False, eos=False)
        assert max(ids) < tok.n_base_tokens
        assert tok.decode(ids) == doc


@pytest.mark.parametrize(
    "text",
    [
        "",
        "héllo wörld — ½ ∑ naïve café",
        "日本語のテキスト、中文文本。한국어",
        "emoji 👩‍👩‍👧 🇫🇷 and combining e\u0301",
        "עברית ومرحبا",
        "tabs\tand\r\nwindows\nnewlines\x00nul",
        "   leading and trailing   ",
        " " * 60_000 + "x" * 60_000,  # runs long enough to need splitting
    ],
)
def test_round_trip_unicode(tok, text):
    assert tok.decode(tok.encode(text, bos=False, eos=False)) == text


def test_bos_eos_flags(tok):
    plain = tok.encode("To be, or not to be", bos=False, eos=False)
    assert tok.encode("To be, or not to be", bos=True, eos=False) == [tok.bos_id, *plain]
    assert tok.encode("To be, or not to be", bos=False, eos=True) == [*plain, tok.eos_id]
    assert tok.encode("To be, or not to be", bos=True, eos=True) == [tok.bos_id, *plain, tok.eos_id]
    assert tok.decode([tok.bos_id]) == "<|begin_of_text|>"


def test_special_token_text_is_encoded_as_ordinary_text(tok):
    text = "<|begin_of_text|>user<|eot_id|><|reserved_special_token_9|>"
    for ids in (tok.encode(text, bos=False, eos=False), tok.encode_batch([text], bos=False, eos=False)[0]):
        assert all(i < tok.n_base_tokens for i in ids)
        assert tok.decode(ids) == text


def test_encode_batch_matches_encode(tok, val_docs):
    texts = val_docs[:8] + ["", "<|eot_id|>", "x" * 30_000]
    assert tok.encode_batch(texts, bos=True, eos=True) == [tok.encode(t, bos=True, eos=True) for t in texts]


def test_compression_on_held_out_text(tok, val_docs):
    n_chars = sum(len(d) for d in val_docs)
    n_tokens = sum(len(ids) for ids in tok.encode_batch(val_docs, bos=False, eos=False))
    assert n_chars / n_tokens > 3.0  # 3.38 when trained; bytes alone would give ~1


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "tokenizer.model"
    with pytest.raises(DataError, match="nope/tokenizer.model"):
        Tokenizer(missing)


@pytest.mark.parametrize(
    "content, why",
    [
        (b"", "empty"),
        (b"this is not base64 rank\n", "not a tiktoken ranks file"),
        (b"QQ== zero\n", "not a tiktoken ranks file"),
    ],
)
def test_corrupt_file_names_the_path(tmp_path, content, why):
    path = tmp_path / "bad.model"
    path.write_bytes(content)
    with pytest.raises(DataError, match=why) as err:
        Tokenizer(path)
    assert str(path) in str(err.value)


def test_rank_gap_is_rejected(tmp_path):
    path = tmp_path / "gap.model"
    lines = [base64.b64encode(t) + b" %d" % r for r, t in enumerate(byte_tokens())]
    lines.append(base64.b64encode(b"ab") + b" 300")  # 256..299 missing
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError, match="without gaps"):
        Tokenizer(path)


def test_missing_single_byte_is_rejected(tmp_path):
    tokens = byte_tokens()
    tokens[65] = b"ab"  # byte 'A' has no rank of its own
    with pytest.raises(DataError, match="0x41"):
        Tokenizer(write_ranks(tmp_path / "t.model", tokens))


def test_rewritten_file_is_not_served_from_tiktokens_cache(tmp_path, monkeypatch):
    # tiktoken caches local files by path; with its cache on, a rewrite must still be seen.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    path = write_ranks(tmp_path / "t.model", byte_tokens() + [b"ab"])
    assert Tokenizer(path).n_base_tokens == 257
    write_ranks(path, byte_tokens() + [b"ab", b"cd", b"ef"])
    rewritten = Tokenizer(path)
    assert rewritten.n_base_tokens == 259 and rewritten.bos_id == 259


def test_script_pattern_matches_runtime_pattern():
    spec = importlib.util.spec_from_file_location("train_tokenizer", REPO / "scripts" / "train_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.LLAMA3_PATTERN == LLAMA3_PATTERN


def test_train_tokenizer_script_regenerates_the_shipped_file(tmp_path):
    out = tmp_path / "tokenizer.model"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train_tokenizer.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TIKTOKEN_CACHE_DIR": ""},
    )
    assert result.returncode == 0, result.stderr
    assert "chars/token" in result.stdout
    assert out.read_bytes() == DEFAULT_TOKENIZER_PATH.read_bytes()


# ----------------------------------------------------------------------------- Hugging Face tokenizer.json


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table, written out here independently of the runtime."""
    keep = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    table = {b: chr(b) for b in keep}
    for n, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + n)
    return table


def tokenizer_json(ranks: dict[bytes, int], *, style: str = "llama3", specials: bool = True) -> dict:
    """A tokenizer.json equivalent to tiktoken `ranks`, built the way HF converts tiktoken files:
    every split of a token into two known tokens is a merge, merges sorted by the rank they make."""
    chars = _byte_chars()
    text = lambda token: "".join(chars[b] for b in token)  # noqa: E731
    merges = []
    for token, _rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [[text(a), text(b)] for a, b in sorted(splits, key=lambda p: (ranks[p[0]], ranks[p[1]]))]
    if style == "llama3":
        pre = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ]}
    else:  # GPT-2: the ByteLevel step splits with its own regex
        pre = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    n = len(ranks)
    added = [
        {"id": n + i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, tok in enumerate(SPECIAL_TOKENS)
    ] if specials else []
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": pre, "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {text(t): r for t, r in ranks.items()}, "merges": merges},
    }


@pytest.fixture(scope="module")
def bundled_ranks() -> dict[bytes, int]:
    lines = DEFAULT_TOKENIZER_PATH.read_bytes().splitlines()
    return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in lines)}


@pytest.mark.parametrize("style", ["llama3", "gpt2"])
def test_tokenizer_json_encodes_like_the_tokenizers_library(tmp_path, bundled_ranks, val_docs, style):
    import tokenizers
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(tokenizer_json(bundled_ranks, style=style)))
    ours, theirs = Tokenizer(path), tokenizers.Tokenizer.from_file(str(path))
    assert ours.vocab_size == theirs.get_vocab_size() == 4352
    assert (ours.bos_id, ours.eos_id, ours.eot_id) == (4096, 4097, 4105)
    texts = val_docs + ["héllo wörld — ½", "日本語のテキスト", "emoji 👩‍👩‍👧", "tabs\tand\r\nnewlines  ", "x" * 3000]
    n_tokens = 0
    for text in texts:
        want = theirs.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, bos=False, eos=False) == want, text[:80]
        assert ours.decode(want) == theirs.decode(want, skip_special_tokens=False) == text
        n_tokens += len(want)
    assert n_tokens > 10_000  # the comparison covered real text, not a handful of tokens
    if style == "llama3":  # the same ranks as the shipped tokenizer.model: identical ids
        shipped = Tokenizer(DEFAULT_TOKENIZER_PATH)
        assert ours.encode_batch(val_docs, bos=True, eos=True) == shipped.encode_batch(val_docs, bos=True, eos=True)


def test_tokenizer_json_without_added_tokens_gets_llama31_specials(tmp_path, bundled_ranks):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(tokenizer_json(bundled_ranks, specials=False)))
    t = Tokenizer(path)
    assert t.vocab_size == 4352 and t.special_tokens == Tokenizer(DEFAULT_TOKENIZER_PATH).special_tokens


@pytest.mark.parametrize(
    "breakage, why",
    [
        ("swap_merges", "out of token-id order"),
        ("few_specials", "special tokens at ids"),
        ("wordpiece", "not byte-level BPE"),
        ("prefix_space", "add_prefix_space"),
        ("not_json", "not valid JSON"),
    ],
)
def test_unusable_tokenizer_json_is_a_one_line_data_error(tmp_path, bundled_ranks, breakage, why):
    spec = tokenizer_json(bundled_ranks)
    if breakage == "swap_merges":
        merges = spec["model"]["merges"]
        merges[10], merges[500] = merges[500], merges[10]
    elif breakage == "few_specials":
        spec["added_tokens"] = spec["added_tokens"][:5]
    elif breakage == "wordpiece":
        spec["model"]["type"] = "WordPiece"
    elif breakage == "prefix_space":
        spec["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = True
    path = tmp_path / "tokenizer.json"
    path.write_text("{ nope" if breakage == "not_json" else json.dumps(spec))
    with pytest.raises(DataError, match=why) as err:
        Tokenizer(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)

"""A Hugging Face byte-level BPE with a tokenizer_config.json (Qwen3's layout: no BOS, eos
<|im_end|>, chat tokens after the base vocabulary) encodes in titanctl exactly as `tokenizers`
and `transformers` encode it. The tokenizer is trained here, offline, on a few sentences."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.unit.data.test_tokenizer import tokenizer_json
from titanctl.checkpoint.hf.tokenizer_export import write_companion_files
from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from titanctl.errors import DataError

# Qwen2's and Qwen3's pre-tokenizer split (transformers' Qwen2Converter): like Llama 3's, but
# digits one at a time.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_CONFIG = {
    "add_bos_token": False, "add_prefix_space": False, "bos_token": None, "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace", "model_max_length": 131072,
    "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "clean_up_tokenization_spaces": False,
}
SENTENCES = [
    "The quick brown fox jumps over the lazy dog. It's 1234 miles away, isn't it?",
    "I'm sure we'll find 42 reasons; they'd say THEY'VE done it 1999 times.\n\nNew paragraph here.",
    "Ünïcödé tëxt, café, naïve — 日本語のテキスト and 中文 text. Emoji: 🙂👍",
    "def main():\n    return [x * 2 for x in range(10)]\n\t# tabs and    spaces   ",
]
TEXTS = [
    "The lazy fox, isn't it? I'm here; you're there. WE'LL see, THEY'D go.",
    "Digits 0123456789 and 3.14159, 2024-12-31, x1y22z333 and ١٢٣ ²³",
    "Lines\n\nwith\r\nbreaks \n  and   runs of    spaces   \t\ttabs\n",
    "unicode: café naïve Ärger straße 日本語 中文 한국어 👩‍👩‍👧 🇫🇷",
    "decomposed e\u0301 and cafe\u0301 become NFC, ﬁ stays",
    "   leading and trailing spaces   ",
    "",
]


def train_qwen_style(folder: Path) -> Path:
    """tokenizer.json + tokenizer_config.json as Qwen3's repository has them, on a toy vocabulary."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    hf.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    hf.train_from_iterator(SENTENCES * 3, trainer=trainer)
    # After training, as Qwen's: the added tokens take the ids right after the base vocabulary.
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ADDED])
    folder.mkdir(parents=True, exist_ok=True)
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(QWEN3_CONFIG, indent=2))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def qwen_json(tmp_path_factory) -> Path:
    return train_qwen_style(tmp_path_factory.mktemp("qwen") / "tok")


@pytest.fixture(scope="module")
def ours(qwen_json) -> Tokenizer:
    return Tokenizer(qwen_json)


def with_config(tmp_path: Path, qwen_json: Path, config: object) -> Path:
    """A copy of the trained tokenizer.json beside `config` (written as JSON unless it is text)."""
    path = tmp_path / "tokenizer.json"
    path.write_bytes(qwen_json.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def test_encodes_and_decodes_as_the_tokenizers_library(qwen_json, ours):
    import tokenizers

    theirs = tokenizers.Tokenizer.from_file(str(qwen_json))
    n_tokens = 0
    for text in [*TEXTS, *SENTENCES]:
        want = theirs.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, bos=False, eos=False) == want, text
        assert ours.decode(want) == theirs.decode(want) == unicodedata.normalize("NFC", text)
        n_tokens += len(want)
    assert n_tokens > 300
    assert ours.encode_batch(TEXTS, bos=True, eos=True) == [ours.encode(t, bos=True, eos=True) for t in TEXTS]


def test_special_tokens_come_from_tokenizer_config(qwen_json, ours):
    import tokenizers

    theirs = tokenizers.Tokenizer.from_file(str(qwen_json))
    n_base = theirs.get_vocab_size() - len(ADDED)
    assert ours.n_base_tokens == n_base
    assert ours.special_tokens == {t: n_base + i for i, t in enumerate(ADDED)}
    assert ours.vocab_size == theirs.get_vocab_size() == n_base + 3  # the highest id + 1, not n_base + 256
    assert ours.bos_id is None
    assert (ours.eos_id, ours.pad_id, ours.eot_id, ours.eom_id) == (n_base + 2, n_base, n_base + 2, None)
    assert ours.stop_tokens == {n_base, n_base + 2}  # end of text and end of turn
    plain = ours.encode("hello world", bos=False, eos=False)
    assert ours.encode("hello world", bos=True, eos=False) == plain  # no BOS to add
    assert ours.encode("hello world", bos=True, eos=True) == [*plain, ours.eos_id]
    # Chat-token text in data stays text, as for Llama's specials.
    assert not set(ours.encode("<|im_start|>user<|im_end|>", bos=False, eos=False)) & set(ours.stop_tokens)


def test_autotokenizer_agrees(qwen_json, ours, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
        transformers = pytest.importorskip("transformers")
        theirs = transformers.AutoTokenizer.from_pretrained(str(qwen_json.parent))
    assert theirs.bos_token_id is None
    assert (theirs.eos_token_id, theirs.pad_token_id, len(theirs)) == (ours.eos_id, ours.pad_id, ours.vocab_size)
    for text in TEXTS:
        ids = theirs(text, add_special_tokens=True)["input_ids"]
        assert ours.encode(text, bos=True, eos=False) == ids, text
        assert theirs.decode(ids) == ours.decode(ids)


def test_old_style_token_objects_and_the_hash(tmp_path, qwen_json, ours):
    config = {**QWEN3_CONFIG, "eos_token": {"__type": "AddedToken", "content": "<|endoftext|>"}}
    other = Tokenizer(with_config(tmp_path, qwen_json, config))
    assert other.eos_id == ours.pad_id
    # The loader keys its token caches by sha256: another eos means other tokens.
    assert other.sha256 != ours.sha256 and other.file_sha256 == ours.file_sha256


@pytest.mark.parametrize(
    "config, why",
    [
        ("{ nope", "not valid JSON"),
        ([1, 2], "the file is a list"),
        ({**QWEN3_CONFIG, "eos_token": ["<|im_end|>"]}, "eos_token is a list"),
        ({**QWEN3_CONFIG, "bos_token": 7}, "bos_token is an integer"),
        ({**QWEN3_CONFIG, "pad_token": {"content": None}}, "pad_token.content is null"),
        ({**QWEN3_CONFIG, "eos_token": "SECRET_MARKER"}, "eos_token is not one of the added tokens"),
        ({**QWEN3_CONFIG, "eos_token": None}, "eos_token is null or missing"),
    ],
)
def test_a_malformed_tokenizer_config_is_a_one_line_data_error(tmp_path, qwen_json, config, why):
    path = with_config(tmp_path, qwen_json, config)
    with pytest.raises(DataError, match=why) as err:
        Tokenizer(path)
    message = str(err.value)
    assert str(tmp_path / "tokenizer_config.json") in message and "\n" not in message
    assert "SECRET_MARKER" not in message


def test_added_tokens_must_follow_the_base_vocabulary(tmp_path, qwen_json):
    spec = json.loads(qwen_json.read_text())
    spec["added_tokens"][-1]["id"] += 5
    path = with_config(tmp_path, qwen_json, QWEN3_CONFIG)
    path.write_text(json.dumps(spec))
    with pytest.raises(DataError, match="must take ids"):
        Tokenizer(path)


def test_without_tokenizer_config_it_is_refused_with_a_hint(tmp_path, qwen_json):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(qwen_json.read_bytes())
    with pytest.raises(DataError, match="expected Llama 3's 256 special tokens.*tokenizer_config.json beside it"):
        Tokenizer(path)


def test_a_llama_tokenizer_json_ignores_a_config_beside_it(tmp_path):
    import base64

    lines = DEFAULT_TOKENIZER_PATH.read_bytes().splitlines()
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in lines)}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(tokenizer_json(ranks)))
    # Llama 3.1 Instruct's config names <|eot_id|> as eos: pre-training keeps <|end_of_text|>.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|eot_id|>"}))
    shipped, t = Tokenizer(DEFAULT_TOKENIZER_PATH), Tokenizer(path)
    assert (t.bos_id, t.eos_id, t.vocab_size, t.stop_tokens) == (4096, 4097, 4352, shipped.stop_tokens)
    assert t.sha256 == t.file_sha256 and t.config_bytes is None


@pytest.mark.parametrize("fmt", ["hf", "dcp"])
def test_exports_carry_the_files_as_they_are(tmp_path, qwen_json, ours, fmt):
    args = SimpleNamespace(max_seq_len=64, vocab_size=ours.vocab_size)
    write_companion_files(tmp_path, fmt, args, ours)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (qwen_json.parent / name).read_bytes()
    assert Tokenizer(tmp_path / "tokenizer.json").sha256 == ours.sha256
    if fmt == "hf":
        generation = json.loads((tmp_path / "generation_config.json").read_text())
        assert generation == {"bos_token_id": None, "eos_token_id": sorted(ours.stop_tokens), "do_sample": False}

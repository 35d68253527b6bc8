"""The tokenizer files an exported model folder needs, built from titanctl's tokenizer.

Hugging Face (``AutoTokenizer``, ``pipeline``, torchtitan 0.3's ``HuggingFaceTokenizer``):
``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json``, and
``generation_config.json``. ``tokenizer.json`` is a byte-level BPE built with the
``tokenizers`` library from the tiktoken ranks:

- vocab: each token's bytes spelled in GPT-2's printable byte alphabet, id = rank;
- merges: tiktoken has none, it merges whichever adjacent pair forms the lowest-ranked
  token. Listing, for every token, each split of it into two tokens, ordered by the
  rank of the token they form, makes "apply the earliest merge" pick the same pair;
  ``ignore_merges`` makes a pre-token that is itself a token one id, as tiktoken does;
- pre-tokenizer: the tokenizer's split regex (Llama 3's), then bytes to the alphabet;
- the 256 special tokens at their ids, and ``<|begin_of_text|>`` prepended on encode.

A tokenizer read from a Hugging Face ``tokenizer.json`` with its own ``tokenizer_config.json``
(Qwen's: no ``<|begin_of_text|>``) is not rebuilt: both files are copied as they are.

torchtune (``llama3_tokenizer``): the tiktoken ranks file ``tokenizer.model`` and
``special_tokens.json``, a ``{"added_tokens": [...]}`` file as torchtune's
``special_tokens_path`` reads it. torchtune 0.6 insists on ``<|step_id|>`` and
``<|image|>`` entries: ``<|step_id|>`` names the id torchtune's own table gives it
(base + 5, Llama 3.1's ``<|reserved_special_token_2|>``) and ``<|image|>`` the id just
past the vocabulary, where torchtune's defaults put it for Meta's (128256); text never
produces either.

Which tokenizer: ``--tokenizer-path``, else the one the checkpoint records
(``titanctl.json``'s ``tokenizer_path``, or a training step folder's ``config.toml``),
else the bundled one when its vocabulary is the model's. A recorded tokenizer is read only
if it is the bundled one or a file inside the checkpoint (relative paths are taken from the
checkpoint folder); a dcp output carries a copy of its tokenizer, so that it stays usable.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from titanctl.checkpoint.hf.names import special_token_ids
from titanctl.checkpoint.trust.metadata import RUN_CONFIG
from titanctl.checkpoint.trust.paths import boundary, inside
from titanctl.data.chat_template import MAX_TEMPLATE_BYTES, TEMPLATE_FILE
from titanctl.data.tokenizer import (
    DEFAULT_TOKENIZER_PATH,
    LLAMA3_PATTERN,
    MAX_TOKENIZER_BYTES,
    TOKENIZER_CONFIG,
    Tokenizer,
)
from titanctl.errors import CheckpointError, DataError
from titanctl.models.registry import spec_of
from titanctl.safe_io import load_toml, read_bytes

if TYPE_CHECKING:
    from titanctl.checkpoint.formats.base import Source
    from titanctl.data.tokenizer import Tokenizer
    from titanctl.models.common.args import ModelArgs

TOKENIZER_JSON = "tokenizer.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
TIKTOKEN_FILE = "tokenizer.model"
TORCHTUNE_SPECIAL_TOKENS = "special_tokens.json"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


# ----------------------------------------------------------------------------- which tokenizer


def recorded_tokenizer_path(source: Source) -> str | None:
    """The tokenizer a checkpoint says it was trained with ("" = the bundled one; None: it does not say)."""
    meta = getattr(source, "meta", None) or {}
    if isinstance(meta.get("tokenizer_path"), str):
        return meta["tokenizer_path"]
    if not os.path.lexists(source.folder / RUN_CONFIG):
        return None
    run_config = inside(source.folder, RUN_CONFIG, f"checkpoint {source.folder}")
    recipe = load_toml(run_config, what="the checkpoint's recipe", error=CheckpointError)
    model = recipe.get("model", {})
    path = model.get("tokenizer_path", "") if isinstance(model, dict) else ""
    return path if isinstance(path, str) else None


def resolve_tokenizer(
    source: Source, args: ModelArgs, tokenizer_path: str | Path | None, record_only: bool = False
) -> tuple[Tokenizer | None, str | None, str]:
    """(tokenizer or None, the path to record for it or None, a note saying which or why none).

    A tokenizer the checkpoint names is read only if it is the bundled one or lies inside the
    checkpoint folder: a checkpoint someone shared must not make titanctl read (and maybe print)
    ``/proc/self/environ`` or a file of the user's. One given with --tokenizer-path is the user's
    choice. A dcp output carries a copy of a tokenizer that is not the bundled one and records it
    by its name in the folder. ``record_only`` (a dcp output): a recorded path is carried as it is
    unless it is a file of the checkpoint; nothing is guessed.
    """
    if tokenizer_path:
        tokenizer = _load(tokenizer_path)
        origin = f"--tokenizer-path {tokenizer_path}"
    else:
        recorded = recorded_tokenizer_path(source)
        if recorded is None:
            return (None, None, "") if record_only else _bundled_if_it_fits(args)
        bundled, in_folder = _bundled_or_inside(source.folder, recorded)
        if record_only and not in_folder:
            return None, recorded, ""
        tokenizer = _load(DEFAULT_TOKENIZER_PATH if bundled else source.folder / recorded)
        origin = f"the checkpoint's tokenizer {'(the bundled one)' if bundled else recorded}"
    if tokenizer.vocab_size != args.vocab_size and not _padded_vocab(args, tokenizer.vocab_size):
        raise CheckpointError(
            f"tokenizer {tokenizer.path} ({origin}) has {tokenizer.vocab_size} tokens but the model's vocabulary "
            f"is {args.vocab_size}: give the tokenizer the model was trained with (--tokenizer-path)"
        )
    return tokenizer, _recorded_as(tokenizer), f"tokenizer: {origin}"


def _padded_vocab(args: ModelArgs, tokenizer_ids: int) -> bool:
    """A model whose embedding has the rows its family publishes, beyond its tokenizer's ids (Qwen3's
    151,936 for 151,669): the extra rows are never produced by the tokenizer."""
    published = {flavor.vocab_size for flavor in spec_of(args).flavors.values()}
    return tokenizer_ids < args.vocab_size and args.vocab_size in published


def _load(path: str | Path) -> Tokenizer:
    try:
        return Tokenizer(path)
    except DataError as e:
        raise CheckpointError(str(e)) from None


def _bundled_if_it_fits(args: ModelArgs) -> tuple[Tokenizer | None, str | None, str]:
    bundled = Tokenizer(DEFAULT_TOKENIZER_PATH)
    if bundled.vocab_size == args.vocab_size:
        return bundled, "", "tokenizer: the bundled one (the checkpoint names none; its vocabulary fits)"
    return None, None, (
        f"no tokenizer files written: the checkpoint names no tokenizer and the model's vocabulary "
        f"({args.vocab_size}) is not the bundled tokenizer's ({bundled.vocab_size}); give --tokenizer-path"
    )


def _is_bundled(path: str | Path) -> bool:
    return Path(os.path.realpath(path)) == DEFAULT_TOKENIZER_PATH.resolve()


def _bundled_or_inside(folder: Path, recorded: str) -> tuple[bool, bool]:
    """(whether `recorded` is the bundled tokenizer, whether it is a file of `folder`); a one-line
    CheckpointError for anything else. A relative path is taken from the folder, not from where
    titanctl runs; links are followed before deciding."""
    if not recorded:
        return True, False
    if "\x00" in recorded:
        raise CheckpointError(f"the checkpoint names tokenizer {recorded!r}, not a path: give --tokenizer-path")
    real = Path(os.path.realpath(folder / recorded))
    if real == DEFAULT_TOKENIZER_PATH.resolve():
        return True, False
    if not real.is_relative_to(boundary(folder)):
        raise CheckpointError(
            f"the checkpoint was trained with tokenizer {recorded}, which is outside the checkpoint folder "
            f"{folder}: titanctl reads no file a checkpoint names outside itself; give --tokenizer-path"
        )
    if not real.exists():
        raise CheckpointError(
            f"the checkpoint was trained with tokenizer {recorded}, which does not exist here: give --tokenizer-path"
        )
    return False, True


def _recorded_as(tokenizer: Tokenizer) -> str:
    """How a dcp output records `tokenizer`: the bundled one by its path, as training does; any
    other by the name of the copy it carries (``write_companion_files``)."""
    if _is_bundled(tokenizer.path):
        return str(DEFAULT_TOKENIZER_PATH.resolve())
    return TOKENIZER_JSON if tokenizer.is_json else TIKTOKEN_FILE


def write_companion_files(folder: Path, fmt: str, args: ModelArgs, tokenizer: Tokenizer | None) -> list[str]:
    """The files beside the weights that make an `fmt` output usable on its own; returns notes."""
    if fmt == "hf":
        write_generation_config(folder, args, tokenizer)
        if tokenizer is not None:
            write_hf_tokenizer(folder, tokenizer, args.max_seq_len)
            write_chat_template(folder, tokenizer)
    elif fmt == "torchtune" and tokenizer is not None:
        why_not = write_torchtune_tokenizer(folder, tokenizer)
        return [why_not] if why_not else []
    elif fmt == "dcp" and tokenizer is not None and not _is_bundled(tokenizer.path):
        (folder / _recorded_as(tokenizer)).write_bytes(tokenizer_bytes(tokenizer))
        if tokenizer.config_bytes is not None:  # it names the special tokens of the copy beside it
            (folder / TOKENIZER_CONFIG).write_bytes(tokenizer.config_bytes)
        write_chat_template(folder, tokenizer)
    return []


def write_chat_template(folder: Path, tokenizer: Tokenizer) -> None:
    """The ``chat_template.jinja`` beside the tokenizer (the bundled one has one; transformers writes
    one beside a Hugging Face tokenizer), copied beside the copy of the tokenizer: a chat-tuned
    model exported with it answers ``apply_chat_template`` and ``infer-tp --chat`` as it was trained.
    A link out of the tokenizer's folder is refused, as any file a checkpoint names."""
    source = Path(tokenizer.path).parent
    if not os.path.lexists(source / TEMPLATE_FILE):
        return
    path = inside(source, TEMPLATE_FILE, f"tokenizer folder {source}")
    data = read_bytes(path, what="chat template", max_bytes=MAX_TEMPLATE_BYTES, error=CheckpointError)
    (folder / TEMPLATE_FILE).write_bytes(data)


# ----------------------------------------------------------------------------- Hugging Face


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in character for each byte value (index = byte)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars: dict[int, str] = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return [chars[b] for b in range(256)]


def bpe_vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A tiktoken BPE as a Hugging Face byte-level vocab and merge list (see the module docstring)."""
    alphabet = _byte_alphabet()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {spell(token): rank for token, rank in ranks.items()}
    merges: list[tuple[int, int, int, str, str]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], spell(left), spell(right)))
    merges.sort()
    return vocab, [(left, right) for *_, left, right in merges]


def hf_tokenizer_json(tokenizer: Tokenizer) -> str:
    """``tokenizer.json`` text of a titanctl tokenizer (byte-level BPE, Llama 3 special tokens)."""
    # tokenizers (Rust): only exports that write a tokenizer.json load it
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    vocab, merges = bpe_vocab_and_merges(tokenizer.ranks)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False, byte_fallback=False))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(tokenizer.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    specials = sorted(tokenizer.special_tokens.items(), key=lambda item: item[1])
    if [i for _, i in specials] != list(range(len(vocab), len(vocab) + len(specials))):
        raise CheckpointError(f"tokenizer {tokenizer.path}: special tokens do not follow the base vocabulary")
    hf.add_special_tokens([AddedToken(name, special=True, normalized=False) for name, _ in specials])
    bos = tokenizer.bos_id
    hf.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos)]
            ),
        ]
    )
    return hf.to_str(pretty=False)


def generation_config(bos_id: int | None, eos_ids: list[int] | int | None) -> dict[str, Any]:
    # Greedy unless asked: transformers' pipeline would otherwise take whatever its defaults say,
    # and a pre-trained model's output should be reproducible.
    return {"bos_token_id": bos_id, "eos_token_id": eos_ids, "do_sample": False}


def write_generation_config(folder: Path, args: ModelArgs, tokenizer: Tokenizer | None) -> None:
    """bos, the stop ids (end of text, of message, of turn: where titanctl's generation stops), greedy."""
    if tokenizer is not None:
        config = generation_config(tokenizer.bos_id, sorted(tokenizer.stop_tokens))
    else:
        bos, eos = special_token_ids(args)
        config = generation_config(bos, eos)
    (folder / GENERATION_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def write_hf_tokenizer(folder: Path, tokenizer: Tokenizer, max_len: int) -> None:
    if tokenizer.config_bytes is not None:
        # A Hugging Face tokenizer with its own config (Qwen's) goes out as it came in: rebuilding it
        # would lose its chat template and added tokens' flags, and it has no <|begin_of_text|>.
        (folder / TOKENIZER_JSON).write_bytes(tokenizer_bytes(tokenizer))
        (folder / TOKENIZER_CONFIG).write_bytes(tokenizer.config_bytes)
        return
    (folder / TOKENIZER_JSON).write_text(hf_tokenizer_json(tokenizer))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": max_len,
    }
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    (folder / SPECIAL_TOKENS_MAP).write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}, indent=2) + "\n")


# ----------------------------------------------------------------------------- torchtune


def tokenizer_bytes(tokenizer: Tokenizer) -> bytes:
    """The tokenizer's own file, read again: refused if it is no longer the file that was loaded."""
    data = read_bytes(tokenizer.path, what="tokenizer file", max_bytes=MAX_TOKENIZER_BYTES, error=CheckpointError)
    if hashlib.sha256(data).hexdigest() != tokenizer.file_sha256:
        raise CheckpointError(f"tokenizer file {tokenizer.path} changed while it was being converted")
    return data


def tiktoken_file_bytes(tokenizer: Tokenizer) -> bytes:
    """The tokenizer's ranks as a tiktoken ``tokenizer.model`` (its own file when it is one)."""
    if not tokenizer.is_json:
        return tokenizer_bytes(tokenizer)
    lines = (f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in sorted(
        tokenizer.ranks.items(), key=lambda item: item[1]))
    return "".join(lines).encode()


def torchtune_special_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    """titanctl's special tokens, with the two entries torchtune 0.6 requires (module docstring)."""
    base = tokenizer.n_base_tokens
    renamed = {tokenizer.n_base_tokens + 5: "<|step_id|>"}
    tokens = {renamed.get(i, name): i for name, i in tokenizer.special_tokens.items()}
    tokens["<|image|>"] = base + len(tokenizer.special_tokens)
    return tokens


def write_torchtune_tokenizer(folder: Path, tokenizer: Tokenizer) -> str | None:
    """Write torchtune's tokenizer files; returns why not when torchtune's Llama 3 tokenizer cannot
    reproduce this one (it always splits with Llama 3's regex)."""
    if tokenizer.pattern != LLAMA3_PATTERN:
        return f"no torchtune tokenizer files: tokenizer {tokenizer.path} does not split text with Llama 3's regex"
    (folder / TIKTOKEN_FILE).write_bytes(tiktoken_file_bytes(tokenizer))
    added = [{"id": i, "content": name, "special": True} for name, i in torchtune_special_tokens(tokenizer).items()]
    added.sort(key=lambda t: t["id"])
    (folder / TORCHTUNE_SPECIAL_TOKENS).write_text(json.dumps({"added_tokens": added}, indent=1) + "\n")
    return None

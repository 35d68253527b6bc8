"""Hugging Face tokenizer folders built offline from the bundled tokenizer, for chat template tests.

Each folder holds a ``tokenizer.json`` that both titanctl and ``transformers.AutoTokenizer`` read,
and a ``tokenizer_config.json`` with the chat template and the special tokens it names:
- ``llama_folder``: the bundled tokenizer exported as Llama 3 (its 256 special tokens), with
  Llama 3.1's template;
- ``qwen_folder``: the bundled ranks with Qwen's added tokens after them (``<|endoftext|>``,
  ``<|im_start|>``, ``<|im_end|>`` special; ``<think>``, ``<tool_call>``... not), NFC normalization
  as Qwen's, no BOS, and a Qwen3 template;
- ``bundled_folder``: the bundled tokenizer exported, with titanctl's own bundled template.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from titanctl.checkpoint.hf.tokenizer_export import bpe_vocab_and_merges, hf_tokenizer_json
from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
BUNDLED_TEMPLATE = DEFAULT_TOKENIZER_PATH.parent / "chat_template.jinja"
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")


def llama_folder(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(hf_tokenizer_json(Tokenizer()))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": False,
              "chat_template": (TEMPLATES / "llama3_1.jinja").read_text()}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def bundled_folder(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(hf_tokenizer_json(Tokenizer()))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|end_of_text|>", "pad_token": "<|finetune_right_pad_id|>",
              "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(BUNDLED_TEMPLATE, folder / "chat_template.jinja")
    return folder


def qwen_folder(folder: Path, template: str = "qwen3.jinja") -> Path:
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    bundled = Tokenizer()
    vocab, merges = bpe_vocab_and_merges(bundled.ranks)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False, byte_fallback=False))
    hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(bundled.pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    hf.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL]
                  + [AddedToken(t, special=False, normalized=False) for t in QWEN_ADDED])
    folder.mkdir(parents=True, exist_ok=True)
    hf.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False,
              "chat_template": (TEMPLATES / template).read_text()}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


WORDS = ("the", "river", "king", "said", "unto", "them", "light", "night", "é", "naïve", "中文", "🙂", "42", "3.14",
         "don't", "  spaced", "tab\there", "line\nbreak", "{json}", "<b>", "x=1;", "\u00a0nbsp")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def sample_conversations(n: int, seed: int = 0, *, tools: bool = True, reasoning: bool = True,
                         inject: str | None = None) -> list[dict]:
    """``n`` varied conversations (rows with ``messages``, some with ``tools``): optional system turn,
    1-4 exchanges, leading/trailing whitespace, non-ASCII text, single tool calls with their result,
    reasoning on some assistant turns; ``inject``: special-token text put into some user turns."""
    import random

    rng = random.Random(seed)

    def text(lo: int = 1, hi: int = 12) -> str:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
        return rng.choice(["", " ", "\n"]) + words + rng.choice(["", " ", "\n", "\n\n"])

    rows = []
    for _ in range(n):
        messages = [{"role": "system", "content": text()}] if rng.random() < 0.4 else []
        row_tools = None
        for _ in range(rng.randint(1, 4)):
            user = text()
            if inject and rng.random() < 0.5:
                user = user + inject + text(1, 3)
            messages.append({"role": "user", "content": user})
            if tools and rng.random() < 0.2:
                row_tools = TOOLS
                city = rng.choice(["Paris", "Łódź", "Kyoto"])
                messages.append({"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}]})
                messages.append({"role": "tool", "content": f'{{"city": "{city}", "celsius": {rng.randint(-9, 30)}}}'})
            answer = {"role": "assistant", "content": text(1, 20)}
            if reasoning and rng.random() < 0.25:
                answer["reasoning_content"] = text(2, 8)
            messages.append(answer)
        rows.append({"messages": messages} if row_tools is None else {"messages": messages, "tools": row_tools})
    return rows

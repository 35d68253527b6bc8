"""An HF export is a complete model folder (tokenizer, generation config) that AutoTokenizer and
pipeline use as titanctl does; a torchtune export carries the tokenizer files torchtune 0.6 needs."""

from __future__ import annotations

import json
import os

import pytest
import tiktoken
import torch
from tiktoken.load import load_tiktoken_bpe

from tests.cli_server import titanctl_run
from tests.conftest import OFFLINE_ENV
from titanctl.checkpoint.convert import convert_checkpoint, save_state_dict
from titanctl.checkpoint.hf.tokenizer_export import bpe_vocab_and_merges
from titanctl.data.datasets import load_documents
from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, LLAMA3_PATTERN, Tokenizer
from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.decoder import Transformer

PROMPTS = ["To be, or not to be", "And God said"]
MAX_NEW = 40


@pytest.fixture(scope="module")
def transformers(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
        import transformers

        yield transformers


@pytest.fixture(scope="module")
def export(trained_debug, tmp_path_factory):
    folder = tmp_path_factory.mktemp("export") / "hf"
    report = convert_checkpoint(trained_debug["folder"], folder)  # dcp -> hf
    assert "tokenizer: the bundled one (the checkpoint names none; its vocabulary fits)" in report.notes
    return folder


def test_hf_export_is_a_complete_model_folder(export):
    names = {p.name for p in export.iterdir()}
    assert names == {"config.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json", "chat_template.jinja"}
    # The bundled tokenizer's chat template travels with it: a chat-tuned export chats as it was trained.
    bundled_template = DEFAULT_TOKENIZER_PATH.parent / "chat_template.jinja"
    assert (export / "chat_template.jinja").read_bytes() == bundled_template.read_bytes()
    tok = Tokenizer()
    generation = json.loads((export / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 4096, "eos_token_id": sorted(tok.stop_tokens), "do_sample": False}
    assert json.loads((export / "special_tokens_map.json").read_text()) == {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}


@pytest.mark.slow
def test_autotokenizer_gives_titanctl_ids_on_the_whole_bundled_corpus(export, transformers):
    theirs = transformers.AutoTokenizer.from_pretrained(export)
    ours = Tokenizer()
    assert (theirs.bos_token_id, theirs.eos_token_id, len(theirs)) == (ours.bos_id, ours.eos_id, ours.vocab_size)
    docs = [doc for split in ("bundled", "bundled_val") for doc in load_documents(split, None)]
    assert len(docs) > 1900
    want = ours.encode_batch(docs, bos=False, eos=False)
    got = theirs(docs, add_special_tokens=False)["input_ids"]
    mismatched = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    assert not mismatched, f"{len(mismatched)} documents differ, first {mismatched[:5]}"
    # By default <|begin_of_text|> comes first, as titanctl's bos=True; decoding gives the text back.
    assert theirs(docs[0])["input_ids"] == ours.encode(docs[0], bos=True, eos=False)
    assert theirs.decode(want[1]) == docs[1]
    # transformers reads the chat template beside the tokenizer: the same ids as titanctl's chat encoding.
    from titanctl.inference.chat_prompt import chat_prompt

    messages = [{"role": "user", "content": "Who speaks first?"}]
    ids = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids == chat_prompt(messages, None, ours, "").ids


def test_the_tokenizer_json_is_read_back_by_titanctl_itself(export):
    """titanctl's tokenizer.json reader (its merge-order check included) gives the same ids."""
    ours, back = Tokenizer(), Tokenizer(export / "tokenizer.json")
    assert back.ranks == ours.ranks and back.special_tokens == ours.special_tokens
    text = next(iter(load_documents("bundled_val", None)))
    assert back.encode(text, bos=True, eos=True) == ours.encode(text, bos=True, eos=True)


def test_merges_are_every_split_in_rank_order():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    vocab, merges = bpe_vocab_and_merges(ranks)
    assert vocab == {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}
    assert merges == [("a", "b"), ("b", "c"), ("a", "bc"), ("ab", "c")]


def test_pipeline_greedy_text_equals_infer_tp(export, transformers, tmp_path):
    pipe = transformers.pipeline("text-generation", model=str(export), dtype=torch.float32)
    for i, prompt in enumerate(PROMPTS):
        out = tmp_path / f"infer{i}.json"
        proc = titanctl_run(["infer-tp", "--checkpoint", str(export), "--prompt", prompt, "--max-new-tokens",
             str(MAX_NEW), "--temperature", "0", "--out", str(out)], env={**os.environ, **OFFLINE_ENV}, timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        ours = json.loads(out.read_text())
        theirs = pipe(prompt, max_new_tokens=MAX_NEW, do_sample=False, return_full_text=False)[0]["generated_text"]
        assert theirs == ours["text"], (prompt, theirs, ours["text"])
        assert len(ours["tokens"]) == MAX_NEW or ours["stop_reason"] == "stop_token"


def test_torchtune_export_carries_its_tokenizer_files(trained_debug, tmp_path):
    convert_checkpoint(trained_debug["folder"], tmp_path / "tt", dst_format="torchtune")
    assert (tmp_path / "tt" / "tokenizer.model").read_bytes() == DEFAULT_TOKENIZER_PATH.read_bytes()
    added = json.loads((tmp_path / "tt" / "special_tokens.json").read_text())["added_tokens"]
    specials = {t["content"]: t["id"] for t in added}  # as torchtune's parse_hf_tokenizer_json reads it
    ours = Tokenizer()
    # What torchtune 0.6.1's Llama3Tokenizer looks up, at titanctl's ids.
    for name in ("<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
                 "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"):
        assert specials[name] == ours.special_tokens[name], name
    assert specials["<|step_id|>"] == ours.n_base_tokens + 5  # torchtune's slot for it (Meta's 128005)
    assert specials["<|image|>"] == ours.vocab_size  # just past the vocabulary, as torchtune's 128256
    assert len(set(specials.values())) == len(specials) == 257
    # torchtune builds a tiktoken Encoding from the two files and Llama 3's regex: the same ids as titanctl.
    enc = tiktoken.Encoding(name="tune", pat_str=LLAMA3_PATTERN,
                            mergeable_ranks=load_tiktoken_bpe(str(tmp_path / "tt" / "tokenizer.model")),
                            special_tokens=specials)
    text = next(iter(load_documents("bundled_val", None)))
    assert enc.encode(text, allowed_special=set(), disallowed_special=()) == ours.encode(text, bos=False, eos=False)


@pytest.mark.slow
def test_tokenizer_is_taken_from_the_option_the_checkpoint_or_nowhere(trained_debug, tmp_path):
    # --tokenizer-path (here a tokenizer.json): a DCP output carries a copy and records it, then uses it.
    convert_checkpoint(trained_debug["folder"], tmp_path / "hf1")
    tok_json = tmp_path / "hf1" / "tokenizer.json"
    convert_checkpoint(trained_debug["folder"], tmp_path / "dcp", dst_format="dcp", tokenizer_path=tok_json)
    assert json.loads((tmp_path / "dcp" / "titanctl.json").read_text())["tokenizer_path"] == "tokenizer.json"
    assert (tmp_path / "dcp" / "tokenizer.json").read_bytes() == tok_json.read_bytes()
    report = convert_checkpoint(tmp_path / "dcp", tmp_path / "hf2")
    assert "tokenizer: the checkpoint's tokenizer tokenizer.json" in report.notes
    assert (tmp_path / "hf2" / "tokenizer.json").read_text() == tok_json.read_text()
    # A training step folder says it in its config.toml; a recorded tokenizer that is gone is an error, and
    # one outside the checkpoint is not read (whether it exists or not).
    step = tmp_path / "step"
    convert_checkpoint(trained_debug["folder"], step, dst_format="dcp")
    (step / "config.toml").write_text('[model]\ntokenizer_path = "gone.model"\n')
    with pytest.raises(CheckpointError, match="trained with tokenizer gone.model, which does not exist here"):
        convert_checkpoint(step, tmp_path / "hf3")
    (step / "config.toml").write_text(f'[model]\ntokenizer_path = "{tok_json}"\n')
    with pytest.raises(CheckpointError, match="trained with tokenizer .*tokenizer.json, which is outside the checkpoint"):
        convert_checkpoint(step, tmp_path / "hf3")
    assert not (tmp_path / "hf3").exists()
    # A vocabulary that is not the tokenizer's: an error when asked for, a note when guessed.
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=300, max_seq_len=32)
    save_state_dict(Transformer(args).state_dict(), args, tmp_path / "small", "dcp")
    with pytest.raises(CheckpointError, match="has 4352 tokens but the model's vocabulary is 300"):
        convert_checkpoint(tmp_path / "small", tmp_path / "hf4", tokenizer_path=DEFAULT_TOKENIZER_PATH)
    report = convert_checkpoint(tmp_path / "small", tmp_path / "hf5")
    assert any(n.startswith("no tokenizer files written") for n in report.notes)
    assert not (tmp_path / "hf5" / "tokenizer.json").exists() and (tmp_path / "hf5" / "generation_config.json").exists()
    with pytest.raises(CheckpointError, match="--tokenizer-path applies to --to hf, torchtune, dcp only"):
        convert_checkpoint(tmp_path / "small", tmp_path / "m", dst_format="meta", tokenizer_path=DEFAULT_TOKENIZER_PATH)


def test_a_training_step_records_its_tokenizer_and_its_hf_export_carries_that_one(tmp_path, transformers):
    """A run trained with its own tokenizer (here the bundled one cut to 3000 ranks: another vocabulary,
    so the bundled default could not pass for it) records its path; `convert --to hf` writes its files."""
    from titanctl.config.recipe import load_config
    from titanctl.train.trainer import Trainer

    own = tmp_path / "elsewhere" / "tokenizer.model"
    own.parent.mkdir()
    own.write_text("\n".join(DEFAULT_TOKENIZER_PATH.read_text().splitlines()[:3000]) + "\n")
    tok = Tokenizer(own)
    assert tok.vocab_size == 3256 != Tokenizer().vocab_size
    Trainer(load_config(None, [
        "--model.tokenizer_path", str(own), "--model.n_layers", "1", "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--training.steps", "1", "--activation_checkpoint.mode", "none",
        "--checkpoint.enable_checkpoint", "--checkpoint.interval", "1", "--job.dump_folder", str(tmp_path / "run"),
    ])).train()
    step = tmp_path / "run" / "checkpoint" / "step-1"
    meta = json.loads((step / "titanctl.json").read_text())
    assert meta["tokenizer_path"] == str(own.resolve())
    assert meta["model_args"]["vocab_size"] == 3256
    # The tokenizer lies outside the checkpoint: not read unless the user names it.
    convert = ["convert", str(step), str(tmp_path / "hf"), "--to", "hf"]
    env = {**os.environ, **OFFLINE_ENV}
    proc = titanctl_run(convert, env=env, timeout=300)
    assert proc.returncode == 2 and "is outside the checkpoint folder" in proc.stderr, proc.stderr[-2000:]
    proc = titanctl_run([*convert, "--tokenizer-path", str(own)], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"note: tokenizer: --tokenizer-path {own}" in proc.stdout, proc.stdout
    back = Tokenizer(tmp_path / "hf" / "tokenizer.json")
    assert back.ranks == tok.ranks and back.special_tokens == tok.special_tokens
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (len(theirs), theirs.bos_token_id, theirs.eos_token_id) == (3256, 3000, 3001)
    text = next(iter(load_documents("bundled_val", None)))
    assert theirs(text, add_special_tokens=False)["input_ids"] == tok.encode(text, bos=False, eos=False)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 3000, "eos_token_id": sorted(tok.stop_tokens), "do_sample": False}


def test_a_chat_template_linked_out_of_the_tokenizers_folder_is_refused(tmp_path):
    from types import SimpleNamespace

    from titanctl.checkpoint.hf.tokenizer_export import write_chat_template

    carried = tmp_path / "checkpoint"
    carried.mkdir()
    (tmp_path / "secret").write_text("not a template")
    (carried / "chat_template.jinja").symlink_to(tmp_path / "secret")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CheckpointError, match="outside"):
        write_chat_template(out, SimpleNamespace(path=str(carried / "tokenizer.json")))
    assert not (out / "chat_template.jinja").exists()

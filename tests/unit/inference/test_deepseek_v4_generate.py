"""`titanctl infer-tp` with a DeepSeek-V4 Hugging Face folder: its greedy tokens equal transformers'
`DeepseekV4ForCausalLM.generate` from the same folder, in process (through the CLI under TP 2:
tests/distributed/test_infer_tp.py), and a generation it cannot do is refused in one line.

The folder is transformers' save_pretrained of the parity test's tiny model (unit-scale weights, so no logits
near a tie; 8 indexer heads, see test_deepseek_v4_decoding.py) with the bundled tokenizer's 4,352 ids and a
context of 64. The 24-token prompt and 30 new tokens reach position 53, past six sliding windows of 8: the CSA
layer's indexer keeps 3 of up to 26 entries, the HCA layer's query sees up to 13.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.unit.inference.test_generate_parity import cached_logits
from tests.unit.models import test_deepseek_v4_parity as parity
from titanctl.data.tokenizer import Tokenizer
from titanctl.inference.generate import Decoder, find_checkpoint, load_model, run

PROMPT = "To be, or not to be, that is the question: whether tis nobler in the mind to suffer"
NEW = 30
CONTEXT = 64


@pytest.fixture(scope="module", autouse=True)
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # run() sizes torch's pool for its one process


def write_folder(folder) -> SimpleNamespace:
    """The model's transformers folder at ``folder`` and what `DeepseekV4ForCausalLM.generate` makes of PROMPT:
    the prompt's ids, the greedy tokens, the logits behind each."""
    import transformers

    vocab = Tokenizer().vocab_size
    parity.reference(index_n_heads=8, vocab_size=vocab, max_position_embeddings=CONTEXT).float().save_pretrained(folder)
    theirs = transformers.DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = Tokenizer().encode(PROMPT, bos=True, eos=False)
    config = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                                           return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        out = theirs.generate(torch.tensor([ids]), generation_config=config)
    return SimpleNamespace(folder=folder, ids=ids, want=out.sequences[0, len(ids):].tolist(),
                           logits=torch.cat(out.logits))


@pytest.fixture(scope="module")
def v4(tmp_path_factory) -> SimpleNamespace:
    return write_folder(tmp_path_factory.mktemp("infer_v4") / "hf")


def test_greedy_tokens_equal_transformers_generate(v4):
    report = run(v4.folder, PROMPT, max_new_tokens=NEW, temperature=0)
    assert report.source.kind == "hf" and report.source.args.family == "deepseek_v4"
    assert report.generation.prompt_tokens == v4.ids and len(v4.ids) == 24
    assert report.generation.tokens == v4.want
    # The logits behind every choice agree too (measured 3.1e-6; the closest top-2 gap 0.011), so equal tokens are not luck of a flat model.
    source = find_checkpoint(v4.folder)
    model = load_model(source, source.args.replace(max_seq_len=len(v4.ids) + NEW), torch.device("cpu"))
    model.setup_kv_cache(len(v4.ids) + NEW)
    try:
        torch.testing.assert_close(cached_logits(model, v4.ids, v4.want), v4.logits, atol=1e-4, rtol=0)
    finally:
        model.clear_kv_cache()


@pytest.mark.parametrize("args, env, message", [
    (["--max-new-tokens", str(CONTEXT - 23)], {},
     "--max-new-tokens 41: the 24-token prompt and the new tokens exceed the model's context of 64 positions; "
     "at most 40 new tokens"),
    ([], {"WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"},
     "model n_heads = 4 is not divisible by the 3 processes of tensor parallel inference: run with a process "
     "count that divides 4 and 2"),
    (["--compile", "--max-new-tokens", "8"], {}, "--compile: the decode step of deepseek_v4 cannot compile as one graph (its MoE routing "
     "runs eagerly: its sizes depend on the data); leave --compile out"),
], ids=["beyond_the_context", "tensor_parallel_3", "compile"])
def test_bad_input_is_one_red_line(v4, args, env, message, monkeypatch, capsys):
    """Before any cache is sized or process group started."""
    from titanctl.cli.app import main

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exc:
        main(["infer-tp", "--checkpoint", str(v4.folder), "--prompt", PROMPT, "--temperature", "0", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in " ".join(err.split()) and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_the_generator_refuses_a_generation_beyond_its_caches(v4):
    source = find_checkpoint(v4.folder)
    model = load_model(source, source.args.replace(max_seq_len=30), torch.device("cpu"))
    decoder = Decoder(model, 30)
    try:
        with pytest.raises(ValueError, match=r"^24 prompt \+ 7 new tokens exceed the 30-position KV cache$"):
            decoder.generate(v4.ids, 7)
        assert len(decoder.generate(v4.ids, 6).tokens) == 6
    finally:
        decoder.close()


def test_a_long_generation_decodes_eagerly_by_default(v4):
    """From 64 new tokens on infer-tp compiles the decode step of other models; this one's MoE routing runs
    between graphs, so it stays eager (a compile would fail)."""
    report = run(v4.folder, "To", max_new_tokens=62, temperature=0)
    assert len(report.generation.prompt_tokens) == 2 and len(report.generation.tokens) == 62
    assert report.compiled is False and report.generation.compile_seconds == 0

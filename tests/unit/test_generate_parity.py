"""Greedy generation equals transformers' `generate()` token for token, on the session's trained
debug model (titanctl's own Hugging Face export loaded into transformers)."""

from __future__ import annotations

import pytest
import torch

from titanctl.checkpoint.convert import convert_checkpoint
from titanctl.data.tokenizer import Tokenizer
from titanctl.tools.generate import Decoder, find_checkpoint, load_model

PROMPTS = ["To be, or not to be", "In the beginning God created", "My lord, the king"]
NEW_TOKENS = 40


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a decoded token's ops are tiny: one thread is faster on a shared machine
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_folder(trained_debug, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gen_parity") / "hf"
    convert_checkpoint(trained_debug["folder"], folder, dst_format="hf")
    return folder


@pytest.fixture(scope="module")
def theirs(hf_folder):
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_generate(trained_debug, theirs):
    """titanctl reads the DCP checkpoint, transformers the HF export of it."""
    from transformers import GenerationConfig

    source = find_checkpoint(trained_debug["folder"])
    tokenizer = Tokenizer()
    prompts = [tokenizer.encode(text, bos=True, eos=False) for text in PROMPTS]
    length = max(map(len, prompts)) + NEW_TOKENS
    model = load_model(source, source.args.replace(max_seq_len=length), torch.device("cpu"))
    decoder = Decoder(model, length)
    # No stop tokens on either side: every prompt runs the full length.
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=tokenizer.eos_id, return_dict_in_generate=True, output_logits=True)
    try:
        for ids in prompts:
            ours = decoder.generate(ids, NEW_TOKENS).tokens
            with torch.no_grad():
                out = theirs.generate(torch.tensor([ids]), generation_config=config)
            assert ours == out.sequences[0, len(ids):].tolist()
            # The logits behind every choice agree too, so equal tokens are not luck of a flat model.
            torch.testing.assert_close(cached_logits(model, ids, ours), torch.cat(out.logits), atol=1e-4, rtol=0)
    finally:
        decoder.close()


@torch.no_grad()
def cached_logits(model, prompt: list[int], new: list[int]) -> torch.Tensor:
    """(len(new), vocab): the logits each new token was chosen from, through the static KV cache."""
    tokens = torch.tensor([prompt + new])
    rows = [model(tokens[:, : len(prompt)], input_pos=torch.arange(len(prompt)))[0, -1:]]
    for pos in range(len(prompt), len(prompt) + len(new) - 1):
        rows.append(model(tokens[:, pos : pos + 1], input_pos=torch.tensor([pos]))[0])
    return torch.cat(rows)

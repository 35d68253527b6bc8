"""Greedy generation equals transformers' `generate()` token for token, on the session's trained
debug model (titanctl's own Hugging Face export loaded into transformers); in chat, on the prompt
that transformers' `apply_chat_template` makes, to the end of the turn."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.chat_tokenizers import bundled_folder
from titanctl.checkpoint.convert import convert_checkpoint
from titanctl.data.tokenizer import Tokenizer
from titanctl.inference.generate import Decoder, find_checkpoint, load_model, run

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


@pytest.mark.slow
def test_chat_greedy_tokens_equal_transformers_generate_to_the_end_of_turn(hf_folder, tmp_path):
    """infer-tp --chat on the Hugging Face export with the bundled tokenizer's chat template beside it. Its
    <|eot_id|> output row is made to score as 1.01 times that of the token generate() picks at step 5, so
    that the turn ends within NEW_TOKENS; generate() stops at Llama 3.1's generation_config eos ids."""
    import transformers

    messages = [{"role": "system", "content": "You speak as a player."}, {"role": "user", "content": PROMPTS[0]},
                {"role": "assistant", "content": "That is the question."}, {"role": "user", "content": PROMPTS[2]}]
    folder = bundled_folder(tmp_path / "chat")  # tokenizer.json, tokenizer_config.json and chat_template.jinja
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])
    eos = tokenizer.convert_tokens_to_ids(["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"])

    def generated() -> list[int]:
        config = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos,
                                               pad_token_id=eos[0])
        with torch.no_grad():
            return theirs.generate(torch.tensor([ids]), generation_config=config)[0, len(ids):].tolist()

    with torch.no_grad():
        theirs.lm_head.weight[eos[2]] = 1.01 * theirs.lm_head.weight[generated()[5]]
    theirs.save_pretrained(folder)  # the weights and config.json beside the tokenizer
    want = generated()
    assert want[-1] == eos[2] and len(want) < NEW_TOKENS  # the turn ended
    report = run(folder, json.dumps(messages), chat=True, max_new_tokens=NEW_TOKENS, temperature=0)
    assert report.generation.prompt_tokens == ids
    assert report.generation.tokens == want and report.generation.stop_reason == "stop_token"
    assert report.text == tokenizer.decode(want[:-1])

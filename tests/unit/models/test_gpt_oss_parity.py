"""gpt-oss (model.name = gpt_oss) equals transformers' GptOssForCausalLM on the same weights, read through
the family's Hugging Face names: both layer kinds (a sliding window shorter than the sequence), attention
sinks, biases on q/k/v/o, YaRN with truncate false, clamped-SwiGLU experts with biases and interleaved
gate/up columns, a biased router taking its softmax after the top-k. The router and the YaRN table equal
transformers'; greedy generation from a save_pretrained folder, through the KV cache over more than two
windows, equals generate()'s; a document mask combines with the sliding window; a transformers-saved folder
comes back from DCP as it was (the conformance suite, with the logits and the sizes)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.unit.hf_reference import IDS, args_of, max_logit_delta, titanctl_model_of
from tests.unit.models.families import GPT_OSS_WINDOW, gpt_oss_config, gpt_oss_model, recipe_in_layout
from titanctl.checkpoint.hf.names import args_from_hf_config, hf_config
from titanctl.inference.generate import find_checkpoint, generate, load_model
from titanctl.models.common.document_mask import document_mask
from titanctl.models.common.flops import active_params
from titanctl.models.common.moe import Router
from titanctl.models.common.rope import rope_table, yarn_frequencies
from titanctl.models.gpt_oss.args import GPT_OSS_FLAVORS, GPT_OSS_YARN

TOL = 1e-5
WINDOW = GPT_OSS_WINDOW


@pytest.fixture(scope="module")
def theirs():
    return gpt_oss_model()


ours_of, delta = titanctl_model_of, max_logit_delta


def test_every_mechanism_moves_the_logits(theirs):
    """The logits equal transformers' (the conformance suite), and each mechanism matters to them."""
    args = args_of(theirs)
    assert args.layer_types == ("sliding_attention", "full_attention") and args.sliding_window == WINDOW
    assert args.attention_sinks and args.attention_bias and args.yarn.truncate is False
    assert delta(ours_of(theirs), theirs) <= TOL
    no_window = ours_of(theirs)
    for layer in no_window.layers.values():
        layer.attention.window = 0
    assert delta(no_window, theirs) > 0.1
    no_sinks = ours_of(theirs)
    with torch.no_grad():
        for layer in no_sinks.layers.values():
            layer.attention.sinks.fill_(-1e9)
    assert delta(no_sinks, theirs) > 0.1
    truncated = ours_of(theirs, args.replace(yarn=dataclasses.replace(args.yarn, truncate=True)))
    assert delta(truncated, theirs) > 1e-3
    swapped = ours_of(theirs)  # gate and up rows exchanged: the interleaving is read right
    with torch.no_grad():
        for layer in swapped.layers.values():
            w13 = layer.moe.experts.w13
            w13.copy_(w13.unflatten(1, (-1, 2)).flip(2).flatten(1, 2))
    assert delta(swapped, theirs) > 0.1
    unbiased = ours_of(theirs)
    with torch.no_grad():
        for layer in unbiased.layers.values():
            layer.attention.wo.bias.zero_()
            layer.moe.experts.b2.zero_()
    assert delta(unbiased, theirs) > 0.1


def test_router_equals_transformers_router():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    config = gpt_oss_config(num_local_experts=16, num_experts_per_tok=4)
    gen = torch.Generator().manual_seed(0)
    reference = GptOssTopKRouter(config)
    moe = args_from_hf_config(config.to_dict()).moe
    ours = Router(config.hidden_size, moe)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(reference.weight.shape, generator=gen))
        reference.bias.copy_(torch.randn(16, generator=gen))
        ours.gate.weight.copy_(reference.weight)
        ours.gate.bias.copy_(reference.bias)
        x = torch.randn(512, config.hidden_size, generator=gen)
        logits, experts, weights = ours(x, torch.zeros(16))
        their_logits, their_weights, their_experts = reference(x)
    order, their_order = experts.argsort(dim=-1), their_experts.argsort(dim=-1)
    assert torch.equal(experts.gather(-1, order), their_experts.gather(-1, their_order))
    torch.testing.assert_close(weights.gather(-1, order), their_weights.gather(-1, their_order), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits, their_logits)


def test_yarn_table_equals_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    config = gpt_oss_config(head_dim=64)
    their_freqs, their_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    freqs, factor = yarn_frequencies(64, 150000.0, GPT_OSS_YARN)
    assert torch.equal(freqs, their_freqs) and factor == their_factor == 0.1 * math.log(32) + 1
    truncated, _ = yarn_frequencies(64, 150000.0, dataclasses.replace(GPT_OSS_YARN, truncate=True))
    assert not torch.equal(truncated, their_freqs)  # truncate false changes the table
    args = GPT_OSS_FLAVORS["20b"].replace(max_seq_len=256)
    cos, sin = GptOssRotaryEmbedding(config)(torch.zeros(1), torch.arange(256)[None])  # (1, T, head_dim / 2)
    table = rope_table(args)  # (T, head_dim // 2, 2)
    assert torch.equal(table[..., 0], cos[0]) and torch.equal(table[..., 1], sin[0])


def test_published_flavors_have_their_active_parameters_and_configs():
    # OpenAI's model card: 3.61B and 5.13B active (with the unembedding); the sizes: the conformance suite.
    for flavor, active in (("20b", 3.61e9), ("120b", 5.13e9)):
        args = GPT_OSS_FLAVORS[flavor]
        assert abs(active_params(args) - active) / active < 1e-2, flavor
        config = hf_config(args)
        assert config["layer_types"][:2] == ["sliding_attention", "full_attention"] and config["sliding_window"] == 128
        assert config["rope_scaling"]["truncate"] is False and config["max_position_embeddings"] == 131072
        assert args_from_hf_config(config, max_seq_len=args.max_seq_len) == args


def test_greedy_generation_beyond_two_windows_equals_transformers_generate(theirs, tmp_path):
    """From the save_pretrained folder, as infer-tp reads it: the KV cache keeps every position and each
    sliding layer's mask its window, with the sinks in every softmax."""
    from transformers import GenerationConfig

    theirs.save_pretrained(tmp_path / "hf")
    prompt, new = IDS[0, :5].tolist(), 3 * WINDOW  # 29 positions: more than two windows
    source = find_checkpoint(tmp_path / "hf")
    model = load_model(source, source.args.replace(max_seq_len=len(prompt) + new), torch.device("cpu"))
    ours = generate(model, prompt, new, temperature=0).tokens
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                              return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        out = theirs.generate(torch.tensor([prompt]), generation_config=config)
    assert ours == out.sequences[0, len(prompt):].tolist()
    # The logits behind every choice agree, so equal tokens are not luck of a flat model.
    tokens = torch.tensor([prompt + ours])
    with torch.no_grad():
        model.setup_kv_cache(len(prompt) + new)
        rows = [model(tokens[:, : len(prompt)], input_pos=torch.arange(len(prompt)))[0, -1:]]
        rows += [model(tokens[:, p : p + 1], input_pos=torch.tensor([p]))[0] for p in range(len(prompt), tokens.shape[1] - 1)]
        model.clear_kv_cache()
    torch.testing.assert_close(torch.cat(rows), torch.cat(out.logits), atol=TOL, rtol=0)


def test_each_document_of_a_packed_window_computes_as_if_alone(theirs):
    """A document mask and each sliding layer's window together: a token sees the last WINDOW positions
    of its own document."""
    model = ours_of(theirs)
    bos = 1
    window = IDS[:1].clone()
    window[0, 0] = window[0, 20] = bos  # two documents: positions 0-19 and 20-47, each longer than a window
    with torch.no_grad():
        packed = model(window, attn_mask=document_mask(window, bos, form="dense"))
        first, second = model(window[:, :20]), model(window[:, 20:])
    assert (packed - torch.cat([first, second], dim=1)).abs().max().item() <= TOL


def test_long_sequences_attend_in_chunks_with_the_same_numbers(theirs, monkeypatch):
    """Past SINK_CHUNK_ELEMENTS of scores the queries go in chunks, each recomputed in backward: the same
    logits and gradients, under the causal mask and a document mask alike."""
    from titanctl.models.gpt_oss import attention

    model = ours_of(theirs)
    bos = 1
    window = IDS.clone()
    window[:, 0] = window[:, 30] = bos

    def run(mask):
        model.zero_grad()
        logits = model(window, attn_mask=mask)
        logits.square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    for mask in (None, document_mask(window, bos, form="dense")):
        whole = run(mask)
        with monkeypatch.context() as m:
            m.setattr(attention, "SINK_CHUNK_ELEMENTS", 2 * 4 * 48 * 10)  # 10 queries a chunk, the last 8
            chunked = run(mask)
        torch.testing.assert_close(chunked[0], whole[0], atol=1e-5, rtol=0)
        for name, grad in whole[1].items():
            torch.testing.assert_close(chunked[1][name], grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("recipe, world, describe", [
    ("gpt_oss_debug", 1, "single process"),
    ("gpt_oss_20b", 8, "dp_shard 8"),
    ("gpt_oss_120b", 64, "dp_shard 64"),
])
def test_recipes_load_and_their_layouts_fit_their_gpus(repo, recipe, world, describe):
    cfg, dims, args = recipe_in_layout(repo, recipe, world)
    assert dims.describe() == describe
    assert args.family == "gpt_oss" and args.sliding_window < cfg.training.seq_len
    assert args.vocab_size == max(4352, GPT_OSS_FLAVORS[cfg.model.flavor].vocab_size)

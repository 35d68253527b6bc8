"""rl.batch_invariant: each sampled token's logprob under the logits it was drawn from (the sampler's decode
step over the KV cache) equals the trainer's logprob of it in a training forward, bit for bit, whatever
the microbatch and whatever other prompts share the sampler's batch; without the mode they differ."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from titanctl.config.recipe import load_config
from titanctl.models.registry import build_model, model_args_from_config
from titanctl.parallel.layouts.weight_init import initialize_weights
from titanctl.rl import batch_invariant as bi
from titanctl.rl.rollout import Sampler, row_keys
from titanctl.rl.update import response_logprobs

CACHE, R = 48, 6  # KV cache positions, response tokens


def tiny_model(name: str, vocab: int) -> torch.nn.Module:
    cfg = load_config(None, ["--model.name", name, "--model.n_layers", "2"])
    torch.manual_seed(0)
    model = build_model(model_args_from_config(cfg.model, vocab, CACHE))
    initialize_weights(model, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # peaked, varied logits: greedy-like ties would hide nothing, flat ones flip
    return model.eval()


def prompts(tok, n: int) -> list[list[int]]:
    return [[tok.bos_id, *range(200 + 7 * i, 200 + 7 * i + 10 + i % 4)] for i in range(n)]


def sample(model, tok, rows: list[list[int]], keys: torch.Tensor, invariant: bool):
    context = (lambda: bi.BatchInvariant(CACHE)) if invariant else contextlib.nullcontext
    sampler = Sampler(model, batch=len(rows), key_length=CACHE, stop_tokens=[tok.eos_id], vocab=tok.vocab_size,
                      temperature=1.0, pad_id=tok.eos_id, forward_context=context)
    try:
        return sampler.sample(rows, keys, R)
    finally:
        sampler.close()


def trainer_logprobs(model, tok, rollout, microbatch: int, invariant: bool) -> torch.Tensor:
    context = bi.BatchInvariant(CACHE) if invariant else contextlib.nullcontext()
    out = []
    with torch.no_grad(), context:
        for start in range(0, rollout.tokens.shape[0], microbatch):
            rows = slice(start, start + microbatch)
            length = int((rollout.prompt_lengths[rows] + rollout.response_lengths[rows]).max()) - 1
            out.append(response_logprobs(model, rollout.tokens[rows], rollout.prompt_lengths[rows], length, R, 1.0,
                                         tok.vocab_size)[0])
    return torch.cat(out)


def sampled(rollout) -> torch.Tensor:
    return rollout.response_lengths[:, None] > torch.arange(R)


@pytest.mark.parametrize("name", ["llama3", "qwen3", "qwen3_moe"])
def test_the_sampler_logprobs_equal_the_trainers_bitwise(tok, name):
    model = tiny_model(name, tok.vocab_size)
    rows = prompts(tok, 6)
    rollout = sample(model, tok, rows, row_keys(0, 0, range(3), 2), invariant=True)
    for microbatch in (6, 4, 1):
        got = trainer_logprobs(model, tok, rollout, microbatch, invariant=True)
        assert torch.equal(got[sampled(rollout)], rollout.logprobs[sampled(rollout)]), microbatch
    default = sample(model, tok, rows, row_keys(0, 0, range(3), 2), invariant=False)
    differ = trainer_logprobs(model, tok, default, 6, invariant=False) - default.logprobs
    assert differ[sampled(default)].abs().max() > 0  # the default kernels round differently


def test_a_prompts_completion_does_not_change_when_others_join_its_batch(tok):
    model = tiny_model("llama3", tok.vocab_size)
    rows = prompts(tok, 5)
    keys = row_keys(7, 3, range(5), 1)
    together = sample(model, tok, rows, keys, invariant=True)
    alone = sample(model, tok, rows[2:3], keys[2:3], invariant=True)
    assert torch.equal(alone.logprobs[0], together.logprobs[2])
    assert alone.response(0) == together.response(2)


def test_each_kernel_computes_a_row_the_same_way_whatever_the_rows_around_it():
    torch.manual_seed(0)
    weight, x = torch.randn(96, 64), torch.randn(1, 64)
    alone = bi.linear(x, weight)
    for rows in (2, 5, 17, 40):
        others = torch.randn(rows, 64)
        others[rows // 2] = x[0]
        assert torch.equal(bi.linear(others, weight)[rows // 2], alone[0]), rows
    torch.testing.assert_close(alone, F.linear(x, weight))  # the same function, other rounding
    values = torch.randn(1000)
    assert torch.equal(bi.silu(values)[-7:], bi.silu(values[-7:]))  # a tensor's tail takes the vector path
    torch.testing.assert_close(bi.silu(values), F.silu(values))


def test_the_tiled_linear_has_the_linears_gradients():
    torch.manual_seed(0)
    weight, x = torch.randn(96, 64, requires_grad=True), torch.randn(3, 37, 64, requires_grad=True)
    grad = torch.randn(3, 37, 96)
    want = torch.autograd.grad(F.linear(x, weight), (x, weight), grad)
    torch.testing.assert_close(torch.autograd.grad(bi.linear(x, weight), (x, weight), grad), want)


def test_attention_scores_a_query_in_decode_as_in_training():
    """A query row attended alone over a cache (decode) equals the same row inside a causal training pass."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 8, 20, 16), torch.randn(3, 2, 20, 16), torch.randn(3, 2, 20, 16)
    training = bi.attention(q, k, v, is_causal=True, enable_gqa=True, key_length=32)
    for t in (0, 7, 19):
        seen = (torch.arange(t + 1) <= t)[None, None, None, :]
        decode = bi.attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], attn_mask=seen, enable_gqa=True,
                              key_length=32)
        assert torch.equal(decode[:, :, 0], training[:, :, t]), t


def test_attention_over_a_padded_cache_is_sdpa():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    got = bi.attention(q, k, v, is_causal=True, enable_gqa=True, key_length=12)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))

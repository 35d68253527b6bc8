"""The RL sampler: tokens drawn from the tempered softmax with noise that depends only on (seed, step, prompt,
completion, position), stop tokens, and MoE routing replay."""

from __future__ import annotations

import torch

from tests.unit.rl.test_batch_invariant import prompts, tiny_model
from titanctl.rl.rollout import RouteRecorder, Sampler, choose, row_keys
from titanctl.rl.update import response_logprobs


def test_gumbel_max_draws_from_the_tempered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20000, -1)
    keys = row_keys(0, 0, range(20000), 1)
    for temperature in (1.0, 0.5):
        tokens, logprobs = choose(logits, keys, torch.full((20000,), 5), temperature, 4)
        want = torch.softmax(logits[0] / temperature, -1)
        got = torch.bincount(tokens, minlength=4).float() / 20000
        torch.testing.assert_close(got, want, atol=0.012, rtol=0)
        torch.testing.assert_close(logprobs, want.log()[tokens])


def test_noise_keys_depend_on_seed_step_prompt_and_completion_only():
    keys = row_keys(3, 7, [4, 5], 2)
    assert keys.tolist() == row_keys(3, 7, [4, 5], 2).tolist() and len(set(keys.tolist())) == 4
    assert row_keys(3, 7, [5], 2).tolist() == keys[2:].tolist()  # prompt 5's keys wherever it is sampled
    assert row_keys(3, 8, [4, 5], 2).tolist() != keys.tolist() and row_keys(4, 7, [4, 5], 2).tolist() != keys.tolist()


def test_completions_end_at_a_stop_token_and_are_padded_after(tok):
    model = tiny_model("llama3", tok.vocab_size)
    rows = prompts(tok, 4)
    # Stop on whatever the first row draws first: that row ends after one token.
    probe = Sampler(model, batch=4, key_length=48, stop_tokens=[], vocab=tok.vocab_size, temperature=1.0,
                    pad_id=tok.eos_id)
    first = probe.sample(rows, row_keys(0, 0, range(4), 1), 5)
    stop = first.response(0)[0]
    sampler = Sampler(model, batch=4, key_length=48, stop_tokens=[stop], vocab=tok.vocab_size, temperature=1.0,
                      pad_id=tok.eos_id)
    out = sampler.sample(rows, row_keys(0, 0, range(4), 1), 5)
    assert out.response(0) == [stop] and out.response_lengths[0] == 1 and bool(out.stopped[0])
    assert out.logprobs[0, 1:].abs().sum() == 0 and out.tokens[0, len(rows[0]) + 1:].eq(tok.eos_id).all()
    for row in range(1, 4):  # the others as without the stop token, up to their own stop
        n = int(out.response_lengths[row])
        assert out.response(row) == first.response(row)[:n]
        assert (n == 5 and not out.stopped[row]) or out.response(row)[-1] == stop


def test_routing_replay_makes_the_training_forward_route_as_the_sampler_did(tok):
    model = tiny_model("qwen3_moe", tok.vocab_size)
    sampler = Sampler(model, batch=3, key_length=48, stop_tokens=[], vocab=tok.vocab_size, temperature=1.0,
                      pad_id=tok.eos_id, record_routes=True)
    rollout = sampler.sample(prompts(tok, 3), row_keys(0, 0, range(3), 1), 4)
    recorder: RouteRecorder = sampler.recorder
    with torch.no_grad():  # the policy moved since sampling: its own choice now differs for some tokens
        for router in recorder.routers.values():
            router.gate.weight.add_(torch.randn_like(router.gate.weight))
    length = int((rollout.prompt_lengths + rollout.response_lengths).max()) - 1
    chosen = {}

    def capture(layer, override):
        def wrapped(experts):
            chosen[layer] = override(experts)
            return chosen[layer]
        return wrapped

    for layer, router in recorder.routers.items():
        router.route_override = capture(layer, router.route_override)
    routes = {i: r[:, :length].reshape(-1, r.shape[-1]) for i, r in rollout.routes.items()}
    valid = (torch.arange(length) < (rollout.prompt_lengths + rollout.response_lengths - 1)[:, None]).flatten()
    with torch.no_grad():
        with recorder.replay(routes):
            response_logprobs(model, rollout.tokens, rollout.prompt_lengths, length, 4, 1.0, tok.vocab_size)
        replayed = {i: c.clone() for i, c in chosen.items()}
        response_logprobs(model, rollout.tokens, rollout.prompt_lengths, length, 4, 1.0, tok.vocab_size)
    for layer in recorder.routers:
        assert torch.equal(replayed[layer][valid], routes[layer][valid])
        assert not torch.equal(chosen[layer][valid], routes[layer][valid])  # without replay: its own choice
    sampler.close()
    assert all(router.route_override is None for router in recorder.routers.values())

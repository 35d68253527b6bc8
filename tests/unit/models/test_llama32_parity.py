"""Llama 3.2's shape of the model, tied embeddings and RoPE scaling factor 32, equals transformers'
LlamaForCausalLM: in Meta's interleaved layout (q/k rows permuted on import, as every HF Llama
checkpoint) and in the "halves" layout (no permutation). Plus the published 1B/3B flavors.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.unit.hf_reference import max_logit_delta as max_delta
from tests.unit.hf_reference import tokens, unit_scale_
from titanctl.checkpoint.hf.names import canonical_name_of, from_hf_state_dict
from titanctl.models.common.args import ModelArgs, RopeScaling
from titanctl.models.common.decoder import Transformer
from titanctl.models.common.rope import rope_frequencies
from titanctl.models.llama.args import LLAMA3_FLAVORS
from titanctl.parallel.layouts.weight_init import initialize_weights

TOL = 1e-4
# Llama 3.2's scaling (factor 32, bands 1 and 4) with original_max_position_embeddings 16, so that
# every frequency of head_dim 8 is in a scaled regime within 48 tokens.
ARGS = ModelArgs(
    dim=64, n_layers=3, n_heads=8, n_kv_heads=2, vocab_size=512, max_seq_len=64, explicit_ffn_hidden_dim=160,
    rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16),
    tie_embeddings=True,
)


@pytest.fixture(scope="module")
def theirs():
    import transformers  # offline: tests/conftest.py sets HF_HUB_OFFLINE etc. and a temporary HF_HOME

    s = ARGS.rope_scaling
    config = transformers.LlamaConfig(
        vocab_size=ARGS.vocab_size, hidden_size=ARGS.dim, intermediate_size=ARGS.ffn_hidden_dim,
        num_hidden_layers=ARGS.n_layers, num_attention_heads=ARGS.n_heads, num_key_value_heads=ARGS.kv_heads,
        rms_norm_eps=ARGS.norm_eps, max_position_embeddings=ARGS.max_seq_len, tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": ARGS.rope_theta, "factor": s.factor,
            "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        },
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    unit_scale_(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.eval()


def test_interleaved_layout_matches_transformers(theirs):
    # transformers derived the same factor-32 frequencies.
    want = rope_frequencies(ARGS.head_dim, ARGS.rope_theta, ARGS.rope_scaling)
    torch.testing.assert_close(theirs.model.rotary_emb.inv_freq, want, rtol=1e-6, atol=0)
    assert not torch.equal(want, rope_frequencies(ARGS.head_dim, ARGS.rope_theta, RopeScaling(8.0, 1.0, 4.0, 16)))
    ours = Transformer(ARGS)
    ours.load_state_dict(from_hf_state_dict(theirs.state_dict(), ARGS), strict=True)  # permutes wq/wk rows
    assert ours.output.weight is ours.tok_embeddings.weight
    delta = max_delta(ours.eval(), theirs, tokens(ARGS.vocab_size))
    assert delta <= TOL, f"max |Δlogit| = {delta:.3g}"


def test_halves_layout_matches_transformers_without_permutation(theirs):
    args = ARGS.replace(rope_layout="halves")
    renamed = {canonical_name_of(name): tensor for name, tensor in theirs.state_dict().items()}
    ours = Transformer(args)
    ours.load_state_dict(renamed, strict=True)
    ids = tokens(ARGS.vocab_size)
    delta = max_delta(ours.eval(), theirs, ids)
    assert delta <= TOL, f"max |Δlogit| = {delta:.3g}"
    interleaved = Transformer(ARGS)  # the same unpermuted rows in Meta's layout: another model
    interleaved.load_state_dict(renamed, strict=True)
    assert max_delta(interleaved.eval(), theirs, ids) > 0.1


@pytest.mark.parametrize(
    "flavor, dim, layers, heads, head_dim", [("1B", 2048, 16, 32, 64), ("3B", 3072, 28, 24, 128)],  # sizes: conformance
)
def test_published_flavors(flavor, dim, layers, heads, head_dim):
    args = LLAMA3_FLAVORS[flavor].replace(vocab_size=128256)
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.head_dim) == (dim, layers, heads, 8, head_dim)
    assert args.ffn_hidden_dim == 8192 and args.tie_embeddings and args.rope_theta == 500000.0
    assert args.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    assert args.rope_layout == "interleaved" and not args.qk_norm and args.norm_eps == 1e-5


def test_meta_build_of_a_tied_llama_trains():
    args = ARGS.replace(vocab_size=1024)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    initialize_weights(model, seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    ids = torch.randint(0, args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    assert abs(loss.item() - math.log(args.vocab_size)) < 0.3
    loss.backward()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # one step moves the one shared table
    before = model.tok_embeddings.weight.detach().clone()
    opt.step()
    assert not torch.equal(model.output.weight, before) and model.output.weight is model.tok_embeddings.weight

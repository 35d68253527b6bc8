"""Qwen3's own mechanisms against transformers' Qwen3ForCausalLM (its logits, round trips and sizes are
the conformance suite's, tests/unit/models/test_conformance.py): the RoPE layout and the QK norm matter,
the published flavors' dimensions, a tied weight counted once, the tie surviving a meta-device build, the
tensor-parallel plan's entries for the per-head QK norms, and KV-cache decoding.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.unit.hf_reference import IDS, max_logit_delta, titanctl_model_of
from tests.unit.models.families import qwen3_model
from titanctl.checkpoint.hf.names import from_hf_state_dict
from titanctl.models.common.decoder import Transformer
from titanctl.models.common.tp_plan import block_plan
from titanctl.models.qwen3.args import QWEN3_FLAVORS, QWEN3_VOCAB_SIZE, qwen3_args
from titanctl.models.shapes import num_params, tied_weights, weight_shapes
from titanctl.parallel.layouts.weight_init import initialize_weights

TOL = 1e-4
# head_dim 32 over dim 64 / 4 heads = 16: the explicit head width is what makes the shapes work.
ARGS = qwen3_args(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn=160, tied=False, head_dim=32).replace(
    vocab_size=512, max_seq_len=64
)


@pytest.mark.slow
def test_layout_and_qk_norm_matter():
    """The comparison has teeth: Meta's interleaved RoPE, or no QK norm, on the same weights differ."""
    theirs = qwen3_model(ARGS)
    interleaved = titanctl_model_of(theirs, ARGS.replace(rope_layout="interleaved"), read_as=ARGS)
    assert max_logit_delta(interleaved, theirs) > 0.1
    no_qk_norm = Transformer(ARGS.replace(qk_norm=False)).eval()
    sd = {k: v for k, v in from_hf_state_dict(theirs.state_dict(), ARGS).items() if "q_norm" not in k and "k_norm" not in k}
    no_qk_norm.load_state_dict(sd, strict=True)
    assert max_logit_delta(no_qk_norm, theirs) > 0.1


# Qwen/Qwen3-* config.json: (dim, layers, heads, kv heads, ffn, tied); their sizes: the conformance suite.
PUBLISHED = {
    "0.6B": (1024, 28, 16, 8, 3072, True),
    "1.7B": (2048, 28, 16, 8, 6144, True),
    "4B": (2560, 36, 32, 8, 9728, True),
    "8B": (4096, 36, 32, 8, 12288, False),
    "14B": (5120, 40, 40, 8, 17408, False),
    "32B": (5120, 64, 64, 8, 25600, False),
}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_flavors(flavor):
    dim, layers, heads, kv, ffn, tied = PUBLISHED[flavor]
    args = QWEN3_FLAVORS[flavor].replace(vocab_size=QWEN3_VOCAB_SIZE)
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.ffn_hidden_dim) == (dim, layers, heads, kv, ffn)
    assert args.head_dim == 128 and args.tie_embeddings == tied and args.qk_norm
    assert args.rope_theta == 1e6 and args.rope_scaling is None and args.norm_eps == 1e-6
    assert args.rope_layout == "halves"


def test_tied_weight_is_counted_once():
    tied = ARGS.replace(tie_embeddings=True)
    model = Transformer(tied)
    assert sum(p.numel() for p in model.parameters()) == num_params(tied)  # parameters() lists it once
    assert num_params(ARGS) - num_params(tied) == ARGS.vocab_size * ARGS.dim
    # Both keys stay in the state dict (load_state_dict wants both); one is marked as the alias.
    assert weight_shapes(tied)["output.weight"] == weight_shapes(tied)["tok_embeddings.weight"]
    assert tied_weights(tied) == {"output.weight": "tok_embeddings.weight"} and tied_weights(ARGS) == {}
    # The shared table is also the output matmul: FLOPs (num_params without the embedding) keep it.
    assert num_params(tied, include_embedding=False) == num_params(tied)


@pytest.mark.slow
def test_meta_build_keeps_the_tie():
    args = QWEN3_FLAVORS["debugmodel"].replace(vocab_size=4352, n_layers=2, max_seq_len=32)
    assert args.tie_embeddings
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")  # torch 2.13 gives each module a new Parameter, untying them
    model.init_buffers("cpu")  # what every caller runs after to_empty: re-ties
    assert model.output.weight is model.tok_embeddings.weight
    initialize_weights(model, seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert torch.equal(model.layers["1"].attention.k_norm.weight, torch.ones(args.head_dim))
    ids = torch.randint(0, args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    # The shared table is drawn small (std 0.02), so the first loss is ~ln V (the token's own logit
    # does not stand out; drawn like an untied output layer it would give ~10.7 here).
    assert loss.isfinite() and abs(loss.item() - math.log(args.vocab_size)) < 0.3
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    loss.backward()
    assert model.tok_embeddings.weight.grad is not None and model.tok_embeddings.weight.grad.isfinite().all()


def test_tp_plan_replicates_the_qk_norms():
    plan = block_plan(qk_norm=True)
    block = Transformer(ARGS.replace(n_layers=1)).layers["0"]
    assert all(block.get_submodule(name) is not None for name in plan)  # every entry names a module
    for name in ("attention.q_norm", "attention.k_norm"):
        style = plan[name]  # weight replicated, the local (B, T, H/tp, head_dim) seen as sharded on heads
        assert vars(style) == {"sequence_sharding": (torch.distributed.tensor.Shard(2),), "use_local_output": True}
    assert "attention.q_norm" not in block_plan()  # Llama's blocks have none


@torch.no_grad()
def test_kv_cache_decoding_equals_the_full_forward():
    """Generation's path (QK norm, then "halves" RoPE at cached positions) gives the training forward's logits."""
    args = ARGS.replace(tie_embeddings=True)
    model = titanctl_model_of(qwen3_model(args), args, read_as=args)
    ids = IDS[:1, :12]
    full = model(ids)
    model.setup_kv_cache(16)
    prefill = model(ids[:, :8], input_pos=torch.arange(8))
    steps = [model(ids[:, t : t + 1], input_pos=torch.tensor([t])) for t in range(8, 12)]
    model.clear_kv_cache()
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, rtol=0, atol=1e-4)

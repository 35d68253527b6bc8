"""Our Qwen3 (the shared decoder with Qwen3's switches) equals transformers' Qwen3ForCausalLM.

Weights move by renaming alone (Qwen3's published layout is RoPE "rotate half"), tied and untied.
Also: the published flavors' sizes, a tied weight counted once, the tie surviving a meta-device
build, and the tensor-parallel plan's entries for the per-head QK norms.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from titanctl.checkpoint.hf.names import from_hf_state_dict, to_hf_state_dict
from titanctl.models.common.args import ModelArgs
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


@pytest.fixture(scope="module")
def transformers():
    import transformers  # offline: tests/conftest.py sets HF_HUB_OFFLINE etc. and a temporary HF_HOME

    return transformers


@torch.no_grad()
def unit_scale(model: torch.nn.Module, seed: int = 0) -> None:
    """Unit-scale weights (FACTS.md): embeddings std 1, matrices std 1/sqrt(fan_in), norms 1 + 0.2 N(0, 1).
    At init scale (std 0.02) attention is nearly uniform and RoPE or QK norm would hardly show."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # a tied weight is listed once
        if "embed" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        elif p.ndim == 2:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
        else:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))


def hf_qwen3(transformers, args: ModelArgs):
    """A random Qwen3ForCausalLM of ``args``' dimensions, with unit-scale weights."""
    config = transformers.Qwen3Config(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        rms_norm_eps=args.norm_eps,
        max_position_embeddings=args.max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        tie_word_embeddings=args.tie_embeddings,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    unit_scale(model)
    return model.eval()


def ours_from(hf_model, args: ModelArgs, model_args: ModelArgs | None = None) -> Transformer:
    """``hf_model``'s weights read as ``args`` say, in a model built with ``model_args`` (default: args)."""
    model = Transformer(model_args or args)
    model.load_state_dict(from_hf_state_dict(hf_model.state_dict(), args), strict=True)
    return model.eval()


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def max_delta(ours: Transformer, theirs, ids: torch.Tensor) -> float:
    return (ours(ids) - theirs(ids).logits).abs().max().item()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers(transformers, tied):
    args = ARGS.replace(tie_embeddings=tied)
    theirs = hf_qwen3(transformers, args)
    assert (theirs.lm_head.weight is theirs.model.embed_tokens.weight) == tied
    ours = ours_from(theirs, args)
    assert (ours.output.weight is ours.tok_embeddings.weight) == tied
    delta = max_delta(ours, theirs, tokens(args.vocab_size))
    assert delta <= TOL, f"max |Δlogit| = {delta:.3g}"
    # Back to Hugging Face names: the same tensors (a tied model writes no lm_head, as transformers).
    back = to_hf_state_dict(ours.state_dict(), args)
    theirs_sd = theirs.state_dict()
    assert set(back) == set(theirs_sd) - ({"lm_head.weight"} if tied else set())
    assert all(torch.equal(back[k], theirs_sd[k]) for k in back)


@pytest.mark.slow
def test_layout_and_qk_norm_matter(transformers):
    """The comparison has teeth: Meta's interleaved RoPE, or no QK norm, on the same weights differ."""
    theirs = hf_qwen3(transformers, ARGS)
    ids = tokens(ARGS.vocab_size)
    interleaved = ours_from(theirs, ARGS, ARGS.replace(rope_layout="interleaved"))
    assert max_delta(interleaved, theirs, ids) > 0.1
    no_qk_norm = Transformer(ARGS.replace(qk_norm=False)).eval()
    sd = {k: v for k, v in from_hf_state_dict(theirs.state_dict(), ARGS).items() if "q_norm" not in k and "k_norm" not in k}
    no_qk_norm.load_state_dict(sd, strict=True)
    assert max_delta(no_qk_norm, theirs, ids) > 0.1


# Qwen/Qwen3-* config.json and model cards: (dim, layers, heads, kv heads, ffn, tied, published total).
PUBLISHED = {
    "0.6B": (1024, 28, 16, 8, 3072, True, 0.6e9),
    "1.7B": (2048, 28, 16, 8, 6144, True, 1.7e9),
    "4B": (2560, 36, 32, 8, 9728, True, 4.0e9),
    "8B": (4096, 36, 32, 8, 12288, False, 8.2e9),
    "14B": (5120, 40, 40, 8, 17408, False, 14.8e9),
    "32B": (5120, 64, 64, 8, 25600, False, 32.8e9),
}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_flavors(flavor):
    dim, layers, heads, kv, ffn, tied, total = PUBLISHED[flavor]
    args = QWEN3_FLAVORS[flavor].replace(vocab_size=QWEN3_VOCAB_SIZE)
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.ffn_hidden_dim) == (dim, layers, heads, kv, ffn)
    assert args.head_dim == 128 and args.tie_embeddings == tied and args.qk_norm
    assert args.rope_theta == 1e6 and args.rope_scaling is None and args.norm_eps == 1e-6
    assert args.rope_layout == "halves"
    n = num_params(args)  # from the shapes of a meta-device build
    assert n == pytest.approx(total, rel=0.02)
    if flavor == "0.6B":
        assert n == 596_049_920  # embedding counted once: 155.6M + 28 x 15.7M + 1024


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
def test_kv_cache_decoding_equals_the_full_forward(transformers):
    """Generation's path (QK norm, then "halves" RoPE at cached positions) gives the training forward's logits."""
    args = ARGS.replace(tie_embeddings=True)
    model = ours_from(hf_qwen3(transformers, args), args)
    ids = tokens(args.vocab_size)[:1, :12]
    full = model(ids)
    model.setup_kv_cache(16)
    prefill = model(ids[:, :8], input_pos=torch.arange(8))
    steps = [model(ids[:, t : t + 1], input_pos=torch.tensor([t])) for t in range(8, 12)]
    model.clear_kv_cache()
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, rtol=0, atol=1e-4)

"""DeepSeek-V4 against transformers' DeepseekV4ForCausalLM built from a tiny random config in-process:
logits and every parameter's gradient, in fp64, on a sequence long enough that every branch acts: 48
tokens over a window of 8, so most keys a query may see are compressed entries (CSA: 24 entries at rate
2, of which the indexer keeps 3; HCA: 12 at rate 4); the first layer is hash-routed. Also: the checks of
the indexer's choice (it does select: the logits move when it keeps all entries), and the one-line
refusals of a schedule the model cannot build."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.unit.hf_reference import unit_scale_
from titanctl.models.deepseek_v4.args import CSA, HCA, SLIDING, CompressYarn, DeepseekV4Args
from titanctl.models.deepseek_v4.model import DeepseekV4

SEQ = 48
LAYER_TYPES = (CSA, HCA, SLIDING)
MLP_TYPES = ("hash_moe", "moe", "moe")


# YaRN on the compressed layers' RoPE, as the published checkpoints have it (factor 16), over a context short
# enough that the 48 tokens are beyond it.
COMPRESS_YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
                 "beta_slow": 1.0}


def tiny_config(compress_yarn: bool = False, **changes):
    """``changes``: config attributes set on top (other tests' variants)."""
    import transformers

    config = transformers.DeepseekV4Config(
        rope_parameters=COMPRESS_YARN if compress_yarn else None,
        vocab_size=128, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
        head_dim=16, partial_rotary_factor=0.5, q_lora_rank=16, o_groups=2, o_lora_rank=8, sliding_window=8,
        layer_types=list(LAYER_TYPES), mlp_layer_types=list(MLP_TYPES),
        compress_rates={CSA: 2, HCA: 4}, index_n_heads=2, index_head_dim=8, index_topk=3,
        hc_mult=2, hc_sinkhorn_iters=20, n_routed_experts=4, num_experts_per_tok=2,
        routed_scaling_factor=1.5, swiglu_limit=10.0, rope_theta=10000.0, compress_rope_theta=160000.0,
        max_position_embeddings=256, tie_word_embeddings=False)
    for name, value in changes.items():
        setattr(config, name, value)
    return config


def args_of(config) -> DeepseekV4Args:
    compress = config.rope_parameters["compress"]
    yarn = None
    if compress["rope_type"] == "yarn":
        yarn = CompressYarn(factor=compress["factor"], beta_fast=compress["beta_fast"],
                            original_max_position_embeddings=compress["original_max_position_embeddings"],
                            beta_slow=compress["beta_slow"])
    return DeepseekV4Args(compress_yarn=yarn,
        vocab_size=config.vocab_size, dim=config.hidden_size, n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads, head_dim=config.head_dim, rope_head_dim=config.qk_rope_head_dim,
        q_lora_rank=config.q_lora_rank, o_groups=config.o_groups, o_lora_rank=config.o_lora_rank,
        sliding_window=config.sliding_window, layer_types=tuple(config.layer_types),
        compress_rates=dict(config.compress_rates), index_n_heads=config.index_n_heads,
        index_head_dim=config.index_head_dim, index_topk=config.index_topk, rope_theta=config.rope_theta,
        compress_rope_theta=config.compress_rope_theta, hc_mult=config.hc_mult,
        hc_sinkhorn_iters=config.hc_sinkhorn_iters, hc_eps=config.hc_eps, num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok, moe_hidden_dim=config.moe_intermediate_size,
        route_scale=config.routed_scaling_factor, swiglu_limit=config.swiglu_limit,
        mlp_layer_types=tuple(config.mlp_layer_types), norm_eps=config.rms_norm_eps,
        tie_embeddings=config.tie_word_embeddings)


def our_name(hf: str) -> str:
    """transformers' in-memory name -> ours."""
    top = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "output.weight", "model.hc_head.hc_fn": "hc_head.fn",
           "model.hc_head.hc_base": "hc_head.base", "model.hc_head.hc_scale": "hc_head.scale"}
    if hf in top:
        return top[hf]
    name = hf.removeprefix("model.")
    name = name.replace("self_attn.compressor.indexer.", "self_attn.indexer.compressor.")
    name = name.replace("indexer.compressor.q_b_proj", "indexer.q_b_proj")
    name = name.replace("indexer.compressor.scorer.weights_proj", "indexer.weights_proj")
    name = name.replace("mlp.gate.weight", "mlp.router.weight")
    name = name.replace("mlp.gate.e_score_correction_bias", "mlp.expert_bias")
    name = name.replace("mlp.gate.tid2eid", "mlp.tid2eid")
    return name


def reference(seed: int = 0, compress_yarn: bool = False, **changes):
    """transformers' model in fp64 at unit scale; sinks, biases and hash table random too."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(compress_yarn, **changes)
    config._experts_implementation = "eager"  # the grouped-mm default has no fp64 kernel
    theirs = transformers.DeepseekV4ForCausalLM(config).to(torch.float64).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        unit_scale_(theirs, gen)
        for name, p in theirs.named_parameters():
            if name.endswith(("position_bias", "sinks", "base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=gen))
        for name, b in theirs.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
            elif name.endswith("tid2eid"):  # two distinct experts per token
                b.copy_(torch.stack([torch.randperm(config.n_routed_experts, generator=gen)[:2]
                                     for _ in range(b.shape[0])]))
    return theirs


def ours_of(theirs) -> DeepseekV4:
    ours = DeepseekV4(args_of(theirs.config)).to(torch.float64)
    ours.load_state_dict({our_name(k): v for k, v in theirs.state_dict().items()}, strict=True)  # buffers too
    return ours.eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("compress_yarn", [False, True], ids=["rope", "compress-yarn"])
def test_logits_and_gradients_equal_transformers(compress_yarn):
    """fp64: max |Δlogit| within 1e-5 of the largest logit (measured 2.1e-7) and every parameter's gradient
    within 2e-5 of its largest entry (measured 4.9e-6 worst). Not ~1e-15: transformers casts to float32 inside
    its norms, hyper-connections, RoPE and indexer even in an fp64 model (ours keeps fp64 there)."""
    theirs = reference(compress_yarn=compress_yarn)
    ours = ours_of(theirs)
    ids = tokens()
    ref = theirs(ids).logits
    got = ours(ids)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), (got - ref).abs().max()
    labels = ids.roll(-1, dims=1).flatten()
    F.cross_entropy(ref.flatten(0, 1), labels).backward()
    F.cross_entropy(got.flatten(0, 1), labels).backward()
    ours_params = dict(ours.named_parameters())
    checked = 0
    for name, p in theirs.named_parameters():
        q = ours_params[our_name(name)]
        if p.grad is None:  # the indexer: its top-k choice carries no gradient, here or there
            assert q.grad is None or not q.grad.any(), name
            continue
        scale = p.grad.abs().max().clamp_min(1e-30)
        assert (q.grad - p.grad).abs().max() <= 2e-5 * scale, (name, (q.grad - p.grad).abs().max(), scale)
        checked += 1
    assert checked > 40


def test_compressed_branches_and_the_indexer_choice_matter():
    """The same weights with the indexer keeping every entry, or without the compressed entries (HCA's
    compressor zeroed): logits move by O(1), so the parity above exercises the selection."""
    theirs = reference()
    ours = ours_of(theirs)
    ids = tokens()
    with torch.no_grad():
        base = ours(ids)
        ours.layers["0"].self_attn.indexer.topk = SEQ
        assert (ours(ids) - base).abs().max() > 1e-2
        ours.layers["0"].self_attn.indexer.topk = 3
        ours.layers["1"].self_attn.compressor.kv_proj.weight.zero_()
        assert (ours(ids) - base).abs().max() > 1e-2


@pytest.mark.parametrize("change, message", [
    (dict(layer_types=(CSA, HCA)), "layer_types has 2 entries for 3 layers"),
    (dict(layer_types=(CSA, "full_attention", SLIDING)), "layer_types has ['full_attention']"),
    (dict(compress_rates={CSA: 3, HCA: 4}), "compress_rates['compressed_sparse_attention'] is 3: it must be"),
    (dict(mlp_layer_types=("moe",)), "mlp_layer_types has 1 entries for 3 layers"),
])
def test_bad_schedules_refused_in_one_line(change, message):
    args = dataclasses.replace(args_of(tiny_config()), **change)
    with pytest.raises(ValueError) as err:
        DeepseekV4(args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_topk_larger_than_the_compressed_length_refused():
    args = args_of(tiny_config())
    args.check(seq_len=SEQ)
    with pytest.raises(ValueError, match=r"index_topk 3 is larger than the compressed length 2 \(seq_len 4"):
        args.check(seq_len=4)


def test_fp32_logits_within_the_design_tolerance():
    """The same weights in fp32, as training runs: max |Δlogit| within DESIGN.md's 1e-4 (measured 6.0e-7),
    the indexer's and the routers' choices the same on both sides."""
    theirs = reference()
    ours = ours_of(theirs).float()
    theirs = theirs.float()
    ids = tokens()
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max() <= 1e-4

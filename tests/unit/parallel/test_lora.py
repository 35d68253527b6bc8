"""LoRA (titanctl.parallel.converters.lora): the forward equals peft's LoRA on the transformers model with
the same base and adapter weights, the adapters exported under peft's names; the base is frozen (no
gradient, no optimizer state); targets, inits and refusals.

peft is a test-only reference, like transformers. Llama keeps Meta's RoPE layout inside titanctl, so
the export permutes B's rows on q_proj/k_proj as the weights' are; Qwen3-MoE's experts are peft
``target_parameters`` on transformers 5's packed gate_up_proj / down_proj.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.hf_reference import unit_scale_
from titanctl.checkpoint.hf.names import from_hf_state_dict
from titanctl.checkpoint.lora.export import peft_adapter
from titanctl.config.job_config import LoRA as LoRAConfig
from titanctl.errors import ConfigError
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.args import ModelArgs as LlamaArgs
from titanctl.models.common.decoder import Transformer
from titanctl.models.qwen3.args import qwen3_args
from titanctl.models.qwen3_moe.args import qwen3_moe_args
from titanctl.parallel.converters.lora import LoRAGroupedExperts, LoRALinear, apply_lora, is_adapter
from titanctl.parallel.layouts.weight_init import initialize_weights
from titanctl.train.optim import build_optimizer

TOL = 1e-5  # of the largest logit
LLAMA = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64, rope_scaling=None)
QWEN3 = qwen3_args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=96, tied=True, head_dim=32).replace(
    vocab_size=256, max_seq_len=64)
QWEN3_MOE = qwen3_moe_args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, experts=4, top_k=2, expert_ffn=32,
                           head_dim=16, vocab_size=256).replace(max_seq_len=64)


@pytest.fixture(scope="module")
def transformers():
    import transformers  # offline: tests/conftest.py

    return transformers


def hf_model(transformers, args: ModelArgs):
    common = dict(
        vocab_size=args.vocab_size, hidden_size=args.dim, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.kv_heads, rms_norm_eps=args.norm_eps,
        max_position_embeddings=args.max_seq_len, tie_word_embeddings=args.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
    )
    if args.family == "llama3":
        config = transformers.LlamaConfig(intermediate_size=args.ffn_hidden_dim, **common)
        cls = transformers.LlamaForCausalLM
    elif args.family == "qwen3":
        config = transformers.Qwen3Config(intermediate_size=args.ffn_hidden_dim, head_dim=args.head_dim, **common)
        cls = transformers.Qwen3ForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=args.moe.hidden_dim, head_dim=args.head_dim,
            num_experts=args.moe.num_experts, num_experts_per_tok=args.moe.top_k, norm_topk_prob=True, **common)
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    unit_scale_(model, torch.Generator().manual_seed(0))
    return model


@torch.no_grad()
def random_adapters(model: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    """Adapters of unit scale (B too: at init B is zero and the adapter adds nothing to compare)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if is_adapter(name):
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return {name: p.detach().clone() for name, p in model.named_parameters() if is_adapter(name)}


def ours_with_lora(theirs, args: ModelArgs, cfg: LoRAConfig) -> tuple[Transformer, dict, dict]:
    model = Transformer(args)
    model.load_state_dict(from_hf_state_dict(theirs.state_dict(), args), strict=True)
    conversion = apply_lora(model, cfg)
    return model.eval(), random_adapters(model), conversion.record()


def peft_model(transformers, theirs, args, adapters, record):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    config, tensors = peft_adapter(adapters, args, record)
    keep = {k: v for k, v in config.items() if k not in ("peft_type", "base_model_name_or_path")}
    model = get_peft_model(theirs, LoraConfig(**keep))
    result = set_peft_model_state_dict(model, tensors)
    assert not result.unexpected_keys, result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k], result.missing_keys
    return model.eval()


CASES = {
    "llama_attention_ffn": (LLAMA, LoRAConfig(rank=4, alpha=8.0, target_modules=["attention", "feed_forward"])),
    "llama_regex_wq_wk": (LLAMA, LoRAConfig(rank=2, alpha=3.0, target_regex=r"layers\.\d+\.attention\.w[qk]")),
    "qwen3_tied_all": (QWEN3, LoRAConfig(rank=4, alpha=4.0, target_modules=["attention", "feed_forward"])),
    "qwen3_moe_experts": (QWEN3_MOE, LoRAConfig(rank=8, alpha=6.0, target_modules=["attention", "moe.experts"])),
    "qwen3_moe_down_only": (QWEN3_MOE, LoRAConfig(rank=8, alpha=2.0, target_modules=["experts.w2", "layers.1.attention.wo"])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_equals_peft(transformers, case):
    args, cfg = CASES[case]
    theirs = hf_model(transformers, args)
    ours, adapters, record = ours_with_lora(theirs, args, cfg)
    ids = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    # float64 where both run it (torch._grouped_mm, our experts' kernel, has no float64): the models'
    # difference is then their RoPE tables' (both computed in float32), not fp32 summation order.
    dtype = torch.float32 if args.moe is not None else torch.float64
    with torch.no_grad():
        base = theirs.to(dtype)(ids).logits
        peft = peft_model(transformers, theirs, args, adapters, record).to(dtype)(ids).logits
        got = ours.to(dtype)(ids)
    scale = peft.abs().max().item()
    delta = (got - peft).abs().max().item()
    moved = (peft - base).abs().max().item()
    print(f"\nLORA {case}: max |Δlogit| vs peft {delta:.2e} of logits up to {scale:.1f} ({dtype}); the adapters "
          f"move logits by up to {moved:.2f}")
    assert moved > 0.1 * scale, "the adapters hardly changed anything: the comparison has no teeth"
    assert delta <= TOL * scale, f"{case}: ours differs from peft's LoRA by {delta:.3g}"


def test_base_is_frozen_and_only_adapters_reach_the_optimizer():
    from titanctl.config.job_config import Optimizer

    model = Transformer(QWEN3_MOE)
    conversion = apply_lora(model, LoRAConfig(rank=8, target_modules=["attention.wq", "moe.experts"]))
    initialize_weights(model, seed=0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(conversion.shapes) and trainable
    assert isinstance(model.layers["0"].attention.wq, LoRALinear)
    assert isinstance(model.layers["0"].moe.experts, LoRAGroupedExperts)
    assert conversion.shapes["layers.0.moe.experts.w1_lora_a"] == (4, 8, 64)
    assert conversion.shapes["layers.0.moe.experts.w2_lora_b"] == (4, 64, 8)
    optimizer = build_optimizer([model], Optimizer(implementation="for-loop"))
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {
        id(p) for n, p in model.named_parameters() if n in trainable}
    # B starts at zero: the model is the base; after a step only adapters moved.
    assert all(torch.equal(p, torch.zeros_like(p)) for n, p in model.named_parameters() if n.endswith("lora_b"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids).float().logsumexp(-1).mean().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
    optimizer.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable


@pytest.mark.parametrize("cfg, message", [
    (LoRAConfig(target_modules=["attention.wz"]), "entry 'attention.wz' names no linear layer"),
    (LoRAConfig(target_regex="layers\\.[0-9"), "is no regular expression"),
    (LoRAConfig(target_regex="attention"), "matches no linear layer"),
    (LoRAConfig(target_modules=["output"]), "output layer of a model whose output layer is its embedding (tied)"),
    (LoRAConfig(target_modules=[]), "nothing to adapt"),
    (LoRAConfig(rank=4, target_modules=["moe.experts"]), "need the rank to be a multiple of 8"),
])
def test_targets_are_checked(cfg, message):
    with torch.device("meta"):
        model = Transformer(QWEN3_MOE if "experts" in str(cfg.target_modules) else QWEN3)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        apply_lora(model, cfg)


def test_a_pipeline_stage_without_adapters_has_a_zero_gradient_norm():
    """Under PP every stage joins the norm's all-reduce, also one whose weights are all frozen."""
    from titanctl.parallel.layouts.dims import ParallelDims
    from titanctl.parallel.layouts.reductions import clip_grad_norm

    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, world_size=1)
    frozen = [torch.nn.Parameter(torch.ones(3), requires_grad=False)]
    assert clip_grad_norm(frozen, 1.0, dims).item() == 0.0


def test_merging_equals_the_adapted_forward_experts_included():
    """convert --merge-lora's source folds W + (alpha / rank) B A into every adapted weight, per expert for a
    stack: the merged plain model computes what the adapted one does."""
    from pathlib import Path

    from titanctl.checkpoint.formats import DictSource
    from titanctl.checkpoint.lora.export import MergedSource

    torch.manual_seed(0)
    base = Transformer(QWEN3_MOE)
    unit_scale_(base, torch.Generator().manual_seed(0))
    adapted = Transformer(QWEN3_MOE)
    adapted.load_state_dict(base.state_dict())
    record = apply_lora(adapted, LoRAConfig(rank=8, alpha=4.0, target_modules=["attention", "moe.experts"])).record()
    adapters = random_adapters(adapted)
    source = DictSource(base.state_dict(), QWEN3_MOE)
    source.bind(QWEN3_MOE, "the test")
    merged = MergedSource(source, adapters, record, Path("<lora step>"), {})
    model = Transformer(QWEN3_MOE)
    model.load_state_dict(dict(merged.iter_tensors()), strict=True)
    ids = torch.randint(0, QWEN3_MOE.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got, before = adapted.eval()(ids), model.eval()(ids), base.eval()(ids)
    scale = want.abs().max().item()
    assert (want - before).abs().max() > 0.1 * scale
    assert (got - want).abs().max() <= TOL * scale


def test_dropout_acts_on_the_adapters_input_while_training_only():
    model = Transformer(LLAMA)
    apply_lora(model, LoRAConfig(rank=4, dropout=0.5, target_modules=["attention.wq"]))
    initialize_weights(model, seed=0)
    random_adapters(model)
    linear = model.layers["0"].attention.wq
    x = torch.randn(2, 8, 64)
    base = torch.nn.functional.linear(x, linear.weight)
    plain = base + linear.lora_scale * (x @ linear.lora_a.T @ linear.lora_b.T)
    with torch.no_grad():
        assert torch.allclose(linear.eval()(x), plain, atol=1e-5)
        torch.manual_seed(0)
        dropped = linear.train()(x)
    assert not torch.allclose(dropped, plain, atol=1e-3)
    # Only the adapter's input is dropped: with B = 0 the output is the base's, whatever the mask.
    with torch.no_grad():
        linear.lora_b.zero_()
        assert torch.equal(linear.train()(x), base)

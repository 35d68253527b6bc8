"""model.norm_type = fused_rmsnorm: the same model as rmsnorm (weights, names, logits within 1e-6 in
fp32, gradients), through torch.nn.functional.rms_norm."""

from __future__ import annotations

import pytest
import torch

from titanctl.config.recipe import load_config
from titanctl.errors import ConfigError
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.decoder import Transformer
from titanctl.models.common.norms import FusedRMSNorm, RMSNorm
from titanctl.models.registry import model_args_from_config
from titanctl.parallel.layouts.weight_init import initialize_weights

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=32)


def pair() -> tuple[Transformer, Transformer]:
    plain = Transformer(ARGS)
    initialize_weights(plain, seed=0)
    with torch.no_grad():  # norm weights other than ones, so the weight multiply is checked too
        for name, p in plain.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    fused = Transformer(ARGS.replace(norm_type="fused_rmsnorm"))
    fused.load_state_dict(plain.state_dict(), strict=True)  # same names, same shapes
    return plain, fused


def test_fused_model_uses_the_fused_norm_everywhere():
    plain, fused = pair()
    norms = [m for m in fused.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * ARGS.n_layers + 1 and all(type(m) is FusedRMSNorm for m in norms)
    assert not any(type(m) is FusedRMSNorm for m in plain.modules())


@pytest.mark.slow
def test_fused_rmsnorm_logits_and_gradients_match_within_1e_6_fp32():
    plain, fused = pair()
    tokens = torch.randint(0, ARGS.vocab_size, (3, 32), generator=torch.Generator().manual_seed(1))
    plain_logits, fused_logits = plain(tokens), fused(tokens)
    assert (plain_logits - fused_logits).abs().max().item() <= 1e-6
    plain_logits.square().mean().backward()
    fused_logits.square().mean().backward()
    for (name, p), (_, q) in zip(plain.named_parameters(), fused.named_parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-7), name


def test_fused_rmsnorm_with_bf16_activations_and_fp32_weight():
    """Under autocast the activations are bf16 and the weight fp32: no fused kernel for mixed
    dtypes, so the weight is applied after the fused normalization; close to the reference."""
    torch.manual_seed(0)
    plain, fused = RMSNorm(64, 1e-5), FusedRMSNorm(64, 1e-5)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        fused.weight.copy_(plain.weight)
    x = torch.randn(4, 8, 64).bfloat16()
    out, ref = fused(x), plain(x)
    assert out.dtype == ref.dtype == torch.float32
    assert torch.allclose(out, ref, rtol=1e-2, atol=1e-2)
    same_dtype = FusedRMSNorm(64, 1e-5).bfloat16()
    assert same_dtype(x).dtype == torch.bfloat16


def test_norm_type_comes_from_the_config_and_is_checked():
    cfg = load_config(None, ["--model.norm_type", "fused_rmsnorm"])
    assert model_args_from_config(cfg.model, 128, 32).norm_type == "fused_rmsnorm"
    assert model_args_from_config(load_config().model, 128, 32).norm_type == "rmsnorm"
    with pytest.raises(ConfigError, match="model.norm_type"):
        load_config(None, ["--model.norm_type", "layernorm"])


def test_every_recipe_chooses_a_norm(repo):
    import tomllib

    for recipe in sorted((repo / "recipes").glob("*.toml")):
        norm = tomllib.loads(recipe.read_text())["model"].get("norm_type")
        assert norm in ("rmsnorm", "fused_rmsnorm"), recipe.name


def test_on_cpu_rms_norm_runs_the_elementwise_ops_forward_and_backward():
    """What docs/performance.md and model.norm_type's help say of the CPU: torch 2.13 has fused rms_norm kernels
    for CUDA only; on CPU aten::_fused_rms_norm decomposes into pow, mean, add, rsqrt and mul, and
    autograd differentiates those (no _fused_rms_norm_backward). If this fails, torch gained a CPU
    kernel: update the docs."""
    from torch.profiler import ProfilerActivity, profile

    norm = FusedRMSNorm(64, 1e-5)
    x = torch.randn(4, 8, 64, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        norm(x).sum().backward()
    events = list(prof.events())
    fused = [e for e in events if e.name == "aten::_fused_rms_norm"]
    assert len(fused) == 1
    inside = {child.name for child in fused[0].cpu_children}
    assert {"aten::pow", "aten::mean", "aten::add_", "aten::rsqrt", "aten::mul"} <= inside, inside
    names = {e.name for e in events}
    assert "aten::_fused_rms_norm_backward" not in names
    assert {"RsqrtBackward0", "PowBackward0", "MeanBackward1"} <= names, names

"""Muon (titanctl.train.muon) and optimizer parameter groups (titanctl.train.param_groups): ten steps equal
Moonlight's algorithm written out here in plain torch, with AdamW (torch's own) for the rest; which
parameters get Muon by default; [[optimizer.groups]] tables and their refusals."""

from __future__ import annotations

import math

import pytest
import torch

from titanctl.config.job_config import Optimizer as OptimizerConfig
from titanctl.config.job_config import OptimizerGroup
from titanctl.config.recipe import load_config
from titanctl.errors import ConfigError
from titanctl.models.common.decoder import Transformer
from titanctl.models.qwen3_moe.args import qwen3_moe_args
from titanctl.parallel.layouts.weight_init import initialize_weights
from titanctl.train.muon import Muon
from titanctl.train.optim import build_optimizer

MOE = qwen3_moe_args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, experts=4, top_k=2, expert_ffn=24,
                     head_dim=8, vocab_size=128).replace(max_seq_len=16)
STEPS, LR, WD, MU = 10, 2e-2, 0.1, 0.95


def _model() -> Transformer:
    model = Transformer(MOE)
    initialize_weights(model, 0)
    return model


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, MOE.vocab_size, (2, 16), generator=gen) for _ in range(STEPS)]


def _loss(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _reference_newton_schulz(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Moonlight's zeropower_via_newtonschulz5, on one matrix, in fp32."""
    x = g.T if g.size(0) > g.size(1) else g
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x.T if g.size(0) > g.size(1) else x


def _reference_run(muon_names: set[str], mu: float = MU, steps: int = 5) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    named = dict(model.named_parameters())
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in muon_names], lr=LR, betas=(0.9, 0.95),
                              eps=1e-8, weight_decay=WD, foreach=False)
    momentum = {n: torch.zeros_like(named[n]) for n in muon_names}
    losses = []
    for tokens in _batches():
        loss = _loss(model, tokens)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for n in muon_names:
                w, g, m = named[n], named[n].grad, momentum[n]
                m.mul_(mu).add_(g)  # M_t = mu M_{t-1} + G_t
                nesterov = g + mu * m
                o = torch.stack([_reference_newton_schulz(e, steps) for e in nesterov]) if w.dim() == 3 \
                    else _reference_newton_schulz(nesterov, steps)
                # W_t = W_{t-1} - lr (0.2 sqrt(max(A, B)) O_t + wd W_{t-1}), in the published code's order
                w.mul_(1 - LR * WD).add_(o, alpha=-LR * 0.2 * math.sqrt(max(w.shape[-2:])))
        adamw.step()
        model.zero_grad()
    return losses, {n: p.detach().clone() for n, p in named.items()}


def _titanctl_run(cfg: OptimizerConfig) -> tuple[list[float], dict[str, torch.Tensor], torch.optim.Optimizer]:
    model = _model()
    optimizer = build_optimizer([model], cfg)
    losses = []
    for tokens in _batches():
        loss = _loss(model, tokens)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, optimizer


def _muon_cfg(**kw) -> OptimizerConfig:
    return OptimizerConfig(name="Muon", lr=LR, weight_decay=WD, **kw)


def _hidden_matrices(experts: bool) -> set[str]:
    names = {n for n, p in _model().named_parameters() if p.dim() == 2 and n.startswith("layers.")
             and not n.endswith("norm.weight")}
    return names | ({n for n, p in _model().named_parameters() if p.dim() == 3} if experts else set())


@pytest.mark.parametrize("experts, mu, steps", [(False, MU, 5), (True, MU, 5), (False, 0.5, 5), (False, MU, 2)],
                         ids=["experts-adamw", "experts-muon", "momentum-0.5", "ns_steps-2"])
def test_ten_steps_equal_the_papers_algorithm(experts, mu, steps):
    muon_names = _hidden_matrices(experts)
    assert any("attention.wq" in n for n in muon_names) and not any("tok_embeddings" in n for n in muon_names)
    ref_losses, ref_params = _reference_run(muon_names, mu, steps)
    losses, params, optimizer = _titanctl_run(_muon_cfg(muon_experts=experts, muon_momentum=mu, muon_ns_steps=steps))
    assert isinstance(optimizer, Muon)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-6, (losses, ref_losses)
    worst = max((params[n] - ref_params[n]).abs().max().item() for n in params)
    assert worst <= 1e-6, worst
    # One momentum buffer per Muon matrix, AdamW's two moments for the rest.
    for group in optimizer.param_groups:
        for p in group["params"]:
            assert set(optimizer.state[p]) == ({"momentum_buffer"} if group["kind"] == "muon"
                                               else {"step", "exp_avg", "exp_avg_sq"})


def test_newton_schulz_orthogonalizes():
    from titanctl.train.muon import newton_schulz

    g = torch.randn(48, 32, generator=torch.Generator().manual_seed(0))
    singular = torch.linalg.svdvals(newton_schulz(g, 5, torch.float32))
    assert 0.6 < singular.min() and singular.max() < 1.25  # the quintic's published band, not exactly 1
    half = newton_schulz(g, 5, torch.bfloat16)  # muon_ns_dtype = "bfloat16": computed in bf16, returned in fp32
    assert half.dtype == torch.float32 and (half - newton_schulz(g, 5, torch.float32)).abs().max() < 0.05


@pytest.mark.parametrize("shape", [(64, 64), (256, 64), (48, 320), (512, 512)])
def test_update_rms_is_about_0_2_as_moonlight_scales_it(shape):
    """The 0.2 sqrt(max(m, n)) scale gives the update of a random m x n matrix an RMS of about 0.2 (Moonlight's
    match to AdamW's update RMS), whatever its shape: Newton-Schulz alone gives 1/sqrt(max(m, n)) (0.04-0.11 here),
    and sqrt(min(m, n)) in place of sqrt(max(m, n)) gives 0.04-0.09 for the non-square ones."""
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.nn.Parameter(torch.randn(shape, generator=gen))
    before = w.detach().clone()
    w.grad = torch.randn(shape, generator=gen)
    Muon([{"params": [w], "kind": "muon"}], lr=LR, weight_decay=0.0).step()
    rms = ((w.detach() - before) / LR).pow(2).mean().sqrt().item()
    assert 0.15 < rms < 0.25, rms  # NS5's singular values lie in ~[0.7, 1.2], not exactly 1: 0.17-0.19 here


def test_groups_choose_optimizer_and_settings():
    cfg = _muon_cfg(groups=[OptimizerGroup(params=r"layers\.0\..*", optimizer="AdamW", lr=1e-3, beta2=0.99),
                            OptimizerGroup(params="layers.1.attention.wq.weight", weight_decay=0.0)])
    optimizer = build_optimizer([_model()], cfg)
    by_setting = {(g["kind"], g["lr"], g["weight_decay"], g["betas"]): len(g["params"]) for g in optimizer.param_groups}
    n_layer0 = sum(1 for n, _ in _model().named_parameters() if n.startswith("layers.0."))
    assert by_setting[("adamw", 1e-3, WD, (0.9, 0.99))] == n_layer0
    assert by_setting[("muon", LR, 0.0, (0.9, 0.95))] == 1


@pytest.mark.parametrize(
    "groups, message",
    [
        ([OptimizerGroup(params=r"layers\.9\..*")], r"optimizer.groups\[0\].params' = .* matches no trainable"),
        ([OptimizerGroup(params=r"layers\.0\..*"), OptimizerGroup(params=r".*attention\.wq\.weight")],
         r"'layers.0.attention.wq.weight' is matched by optimizer.groups\[0\] and optimizer.groups\[1\]"),
        ([OptimizerGroup(params="norm.weight", optimizer="Muon")], r"gives Muon to 'norm.weight', which is not a"),
        ([OptimizerGroup(params="(")], "is no regular expression"),
        ([OptimizerGroup(params="norm.weight", momentum=0.9)],
         r"'optimizer.groups\[0\].momentum' is Muon's, but every parameter of that group uses AdamW"),
        ([OptimizerGroup(params=r"layers\.0\.attention\.w.\.weight", beta2=0.99)],
         r"'optimizer.groups\[0\].beta2' is AdamW's, but every parameter of that group uses Muon"),
    ],
    ids=["matches-nothing", "two-groups", "muon-on-a-vector", "bad-regex", "momentum-unread", "beta-unread"],
)
def test_group_refusals_are_one_line(groups, message):
    with pytest.raises(ConfigError, match=message) as e:
        build_optimizer([_model()], _muon_cfg(groups=groups))
    assert "\n" not in str(e.value)


def test_groups_load_from_a_recipe(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[optimizer]\nname = "Muon"\n[[optimizer.groups]]\nparams = "output.weight"\nlr = 0.001\n'
                      '[[optimizer.groups]]\nparams = "tok_embeddings.weight"\noptimizer = "Adam"\n')
    with pytest.raises(ConfigError, match=r"'optimizer.groups\[1\].optimizer' = 'Adam' is not one of Muon, AdamW"):
        load_config(recipe)
    recipe.write_text(recipe.read_text().replace('"Adam"', '"AdamW"'))
    with pytest.raises(ConfigError, match=r"'optimizer.groups\[1\].optimizer' = 'AdamW' needs optimizer.name Muon"):
        load_config(recipe, ["--optimizer.name", "Adam"])
    groups = load_config(recipe).optimizer.groups
    assert [(g.params, g.optimizer, g.lr) for g in groups] == [("output.weight", "", 0.001),
                                                               ("tok_embeddings.weight", "AdamW", None)]

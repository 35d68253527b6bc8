"""Every optimizer key changes the update as its help says: titanctl's optimizer (train/optim.py,
param_groups.py, muon.py) against torch's own optimizers given the same settings by hand, and against the
default settings (so a key that is accepted and ignored fails). Each run is three steps of the same random
gradients on a tiny MoE model, which has every kind of parameter: embeddings, norms, attention, a router,
expert stacks, the output layer. Clipping and the LR schedule through a Trainer: test_clipping.py; the
schedule's shapes: test_lr_schedule.py; Muon against the paper's algorithm: test_muon.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titanctl.config.job_config import LRScheduler, OptimizerGroup
from titanctl.config.job_config import Optimizer as OptimizerConfig
from titanctl.models.common.decoder import Transformer
from titanctl.models.qwen3_moe.args import qwen3_moe_args
from titanctl.parallel.layouts.weight_init import initialize_weights
from titanctl.train.lr_schedule import build_lr_scheduler
from titanctl.train.optim import build_optimizer

MOE = qwen3_moe_args(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, experts=4, top_k=2, expert_ffn=24,
                     head_dim=8, vocab_size=64).replace(max_seq_len=16)
STEPS = 3
BASE = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _model() -> Transformer:
    model = Transformer(MOE)
    initialize_weights(model, 0)
    return model


def _grads(model: torch.nn.Module, step: int, scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(step)
    for _, p in sorted(model.named_parameters()):
        p.grad = torch.randn(p.shape, generator=gen) * scale


def _run(opt_of, model=None, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """The parameters after STEPS steps of ``opt_of(model)``."""
    model = model or _model()
    opt = opt_of(model)
    for step in range(STEPS):
        _grads(model, step, scale)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _ours(**settings):
    return lambda model: build_optimizer([model], OptimizerConfig(**{**BASE, "implementation": "for-loop", **settings}))


def _torch(cls=torch.optim.AdamW, **settings):
    s = {**BASE, **settings}
    return lambda model: cls(model.parameters(), lr=s["lr"], betas=(s["beta1"], s["beta2"]), eps=s["eps"],
                             weight_decay=s["weight_decay"], foreach=False)


def _worst(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.parametrize("key, value, scale", [
    ("lr", 3e-2, 1.0), ("beta1", 0.5, 1.0), ("beta2", 0.5, 1.0),
    ("eps", 1e-2, 1e-2),  # gradients near eps, where it matters
    ("weight_decay", 0.5, 1.0),
])
@pytest.mark.parametrize("name, cls", [("AdamW", torch.optim.AdamW), ("Adam", torch.optim.Adam)])
def test_each_adam_key_gives_torchs_update(name, cls, key, value, scale):
    ours = _run(_ours(name=name, **{key: value}), scale=scale)
    assert _worst(ours, _run(_torch(cls, **{key: value}), scale=scale)) < 1e-6
    assert _worst(ours, _run(_torch(cls), scale=scale)) > 1e-4, f"{key} = {value} changed nothing"


def test_adam_adds_weight_decay_to_the_gradient_and_adamw_decouples_it():
    adam, adamw = _run(_ours(name="Adam")), _run(_ours(name="AdamW"))
    assert _worst(adam, adamw) > 1e-4


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_weight_decay_reaches_every_parameter(name):
    """As the help says: every trainable parameter decays, norms, biases, embeddings and routers included
    (a zero gradient leaves only the decay: w <- w (1 - lr wd))."""
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = _ours(name=name)(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    factor = 1 - BASE["lr"] * BASE["weight_decay"]
    for n, p in model.named_parameters():
        assert torch.allclose(p.detach(), before[n] * factor, rtol=1e-6, atol=0), n


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_each_implementation_is_the_same_update_with_its_kernel(implementation):
    opt = _ours(implementation=implementation)(_model())
    assert opt.defaults[implementation] is True
    assert _worst(_run(_ours(implementation=implementation)), _run(_torch())) < 1e-6


def test_a_groups_settings_reach_its_parameters_alone():
    """[[optimizer.groups]] lr, weight_decay, beta1, beta2 and eps, against torch's param groups."""
    table = OptimizerGroup(params=r"layers\.0\.attention\..*", lr=3e-2, weight_decay=0.0, beta1=0.5, beta2=0.8,
                           eps=1e-3)
    in_table = lambda n: n.startswith("layers.0.attention.")  # noqa: E731

    def reference(model):
        named = dict(model.named_parameters())
        return torch.optim.AdamW(
            [{"params": [p for n, p in named.items() if not in_table(n)]},
             {"params": [p for n, p in named.items() if in_table(n)], "lr": 3e-2, "weight_decay": 0.0,
              "betas": (0.5, 0.8), "eps": 1e-3}],
            lr=BASE["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=BASE["weight_decay"], foreach=False)

    ours = _run(_ours(groups=[table]), scale=1e-3)
    assert _worst(ours, _run(reference, scale=1e-3)) < 1e-6
    untouched = _run(_ours(), scale=1e-3)
    assert all(torch.equal(ours[n], untouched[n]) for n in ours if not in_table(n))
    assert all(not torch.equal(ours[n], untouched[n]) for n in ours if in_table(n))


def test_the_schedule_scales_each_groups_own_lr():
    model = _model()
    opt = _ours(groups=[OptimizerGroup(params="output.weight", lr=1.0)])(model)
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=1, lr_min=0.5), total_steps=3)
    seen = []
    for _ in range(3):
        seen.extend(sorted(g["lr"] for g in opt.param_groups))
        opt.step()
        sched.step()
    # warmup 1/2, then linear decay over 2 steps to lr_min 0.5: 0.75, 0.5
    assert seen == pytest.approx([BASE["lr"] / 2, 0.5, BASE["lr"] * 0.75, 0.75, BASE["lr"] * 0.5, 0.5])


@pytest.mark.parametrize("key, value", [("muon_momentum", 0.5), ("muon_ns_steps", 2), ("muon_ns_dtype", "bfloat16"),
                                        ("muon_experts", True)])
def test_each_muon_key_changes_the_update(key, value):
    """Muon's keys act (their values against the paper's algorithm: test_muon.py) and a group's momentum too."""
    ours = _run(_ours(name="Muon", **{key: value}))
    assert _worst(ours, _run(_ours(name="Muon"))) > 1e-4, f"{key} = {value} changed nothing"


def test_a_groups_muon_momentum_reaches_its_matrices():
    table = OptimizerGroup(params=r"layers\.0\.attention\.wq\.weight", momentum=0.5)
    ours, default = _run(_ours(name="Muon", groups=[table])), _run(_ours(name="Muon"))
    changed = {n for n in ours if not torch.equal(ours[n], default[n])}
    assert changed == {"layers.0.attention.wq.weight"}


def test_every_optimizer_key_is_covered_here():
    """A new optimizer key gets its test in this file."""
    covered = {"name", "lr", "beta1", "beta2", "eps", "weight_decay", "implementation", "groups", "muon_momentum",
               "muon_ns_steps", "muon_ns_dtype", "muon_experts"}
    assert {f.name for f in dataclasses.fields(OptimizerConfig)} == covered
    assert {f.name for f in dataclasses.fields(OptimizerGroup)} == {"params", "optimizer", "lr", "weight_decay",
                                                                    "momentum", "beta1", "beta2", "eps"}

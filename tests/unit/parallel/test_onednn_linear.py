"""fp32 linears through oneDNN: the same products and gradients as torch's linear, the fallbacks
where oneDNN is not the kernel to use, and the converter's place in the model build."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from titanctl.config.recipe import load_config
from titanctl.data.tokenizer import Tokenizer
from titanctl.models.registry import model_args_from_config
from titanctl.parallel.converters import onednn_linear
from titanctl.parallel.converters.onednn_linear import (
    OneDNNLinear,
    linear_kernel,
    onednn_available,
    onednn_mm_t,
    use_onednn_linears,
)
from titanctl.parallel.layouts.build import build_model_parts
from titanctl.parallel.layouts.dims import ParallelDims


def test_this_torch_has_onednn():
    assert onednn_available()  # the project's CPU wheel: every test below runs the real kernel


def pair(in_features=48, out_features=40):
    torch.manual_seed(0)
    plain = nn.Linear(in_features, out_features, bias=False)
    converted = nn.Linear(in_features, out_features, bias=False)
    converted.load_state_dict(plain.state_dict())
    assert use_onednn_linears(converted) == 1
    return plain, converted


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("shape", [(6, 48), (2, 5, 48), (2, 3, 4, 48)])
def test_forward_and_gradients_equal_torch_linear(shape):
    plain, converted = pair()
    assert type(converted) is OneDNNLinear
    x = torch.randn(shape)
    grad_out = torch.randn(*shape[:-1], 40)
    outs, grads = [], []
    for layer in (plain, converted):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(grad_out)
        outs.append(y.detach())
        grads.append((xi.grad, layer.weight.grad))
    assert rel(outs[1], outs[0]) < 1e-6
    assert rel(grads[1][0], grads[0][0]) < 1e-6
    assert rel(grads[1][1], grads[0][1]) < 1e-6


def test_the_output_is_not_a_view():
    """Like torch's linear (FSDP warns when a module returns a view)."""
    _, converted = pair()
    assert not converted(torch.randn(2, 3, 48))._is_view()


def test_non_contiguous_gradient():
    """A transposed upstream gradient (as attention's output projection receives) is fine."""
    plain, converted = pair()
    x = torch.randn(5, 2, 48).transpose(0, 1)  # non-contiguous input
    g = torch.randn(5, 2, 40).transpose(0, 1)
    for layer in (plain, converted):
        layer(x.requires_grad_()).backward(g)
    assert rel(converted.weight.grad, plain.weight.grad) < 1e-6


def test_the_custom_op_is_the_kernel_in_fp32(monkeypatch):
    calls = []
    linear, unsafe_view = onednn_linear._kernels()
    monkeypatch.setattr(onednn_linear, "_kernels", lambda: (lambda *a: calls.append(1) or linear(*a), unsafe_view))
    _, converted = pair()
    converted(torch.randn(3, 48, requires_grad=True)).sum().backward()
    assert len(calls) == 3  # forward, input gradient, weight gradient


def test_falls_back_to_torch_under_autocast_and_for_bf16():
    _, converted = pair()
    x = torch.randn(3, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert converted(x).dtype == torch.bfloat16  # autocast's linear, not the fp32 op
    converted.to(torch.bfloat16)
    assert torch.equal(converted(x.bfloat16()), F.linear(x.bfloat16(), converted.weight))


def test_compiles_and_runs_on_fake_tensors():
    plain, converted = pair()
    compiled = torch.compile(converted, fullgraph=True)
    x = torch.randn(4, 48, requires_grad=True)
    y = compiled(x)
    y.sum().backward()
    assert rel(y.detach(), plain(x).detach()) < 1e-6
    mode = FakeTensorMode()
    fake_x, fake_w = mode.from_tensor(torch.randn(2, 7, 48)), mode.from_tensor(converted.weight.detach())
    with mode:
        assert onednn_mm_t(fake_x, fake_w).shape == (2, 7, 40)


@pytest.mark.parametrize("kernel, expected", [("onednn", OneDNNLinear), ("aten", nn.Linear)])
def test_the_build_converts_cpu_linears_by_config(kernel, expected):
    cfg = load_config(None, ["--model.n_layers", "1", "--training.seq_len", "16",
                             "--training.cpu_linear", kernel])
    args = model_args_from_config(cfg.model, Tokenizer().vocab_size, cfg.training.seq_len)
    dims = ParallelDims.from_config(cfg.parallelism, 1)
    model = build_model_parts(cfg, dims, args, torch.device("cpu")).parts[0]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 8  # 7 per block + the output layer
    assert {type(m) for m in linears} == {expected}


@pytest.mark.parametrize("capability, onednn_cap, expected", [
    ("AVX512", None, "onednn"), ("AVX512", "AVX512_CORE_BF16", "onednn"), ("AVX512", "AVX2", "aten"),
    ("AVX2", None, "aten"), ("DEFAULT", None, "aten"),
])
def test_auto_picks_onednn_only_where_it_runs_avx512(monkeypatch, capability, onednn_cap, expected):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    if onednn_cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn_cap)
    assert linear_kernel("auto") == expected
    assert linear_kernel("aten") == "aten" and linear_kernel("onednn") == "onednn"


def test_op_level_ac_saves_every_other_onednn_product_as_it_does_aten_mm():
    """Op-level selective AC keeps every second matmul's output; a oneDNN linear's product is one (the default
    kernel on AVX-512 CPUs): without it the policy saved no linear's output there, so selective_op ran as
    full AC, and estimate-memory's peak for the debug recipes was full AC's, the plan's fast path 15-20% above."""
    from types import SimpleNamespace

    from torch.utils.checkpoint import CheckpointPolicy

    from titanctl.parallel.layouts.activation_checkpoint import _op_policy

    for op in (torch.ops.aten.mm.default, torch.ops.titanctl.onednn_mm_t.default):
        policy, forward = _op_policy(set()), SimpleNamespace(is_recompute=False)
        assert [policy(forward, op) for _ in range(4)] == [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE] * 2

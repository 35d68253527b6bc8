"""The shared MoE layer (titanctl.models.common.moe) in Qwen3-MoE's shape equals transformers'
Qwen3MoeForCausalLM on the same weights (its packed experts read by titanctl's Hugging Face names),
routes deterministically, and its grouped GEMMs equal a loop over experts, gradients included."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tests.unit.hf_reference import max_logit_delta, titanctl_model_of, unit_scale_
from titanctl.models.common.args import MoEArgs
from titanctl.models.common.moe import MoE
from titanctl.models.gpt_oss.experts import experts as gpt_oss_experts
from titanctl.models.qwen3_moe.args import qwen3_moe_args

TOL = 1e-4
F = 32
ARGS = qwen3_moe_args(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, experts=8, top_k=2, expert_ffn=F, head_dim=32,
                      vocab_size=512).replace(max_seq_len=64)

@pytest.fixture(scope="module")
def theirs():
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=ARGS.vocab_size, hidden_size=ARGS.dim, intermediate_size=96, moe_intermediate_size=F,
        num_hidden_layers=ARGS.n_layers, num_attention_heads=ARGS.n_heads, num_key_value_heads=ARGS.kv_heads,
        head_dim=ARGS.head_dim, num_experts=ARGS.moe.num_experts, num_experts_per_tok=ARGS.moe.top_k,
        norm_topk_prob=True, rms_norm_eps=ARGS.norm_eps, max_position_embeddings=ARGS.max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": ARGS.rope_theta}, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    unit_scale_(model, torch.Generator().manual_seed(0))
    return model


def test_renormalizing_the_chosen_weights_matters(theirs):
    """The logits equal transformers' (the conformance suite); without renormalizing the top-k weights they
    differ: the comparison sees the router's normalization."""
    assert max_logit_delta(titanctl_model_of(theirs, read_as=ARGS), theirs) <= TOL
    unnormalized = ARGS.replace(moe=dataclasses.replace(ARGS.moe, norm_topk_prob=False))
    assert max_logit_delta(titanctl_model_of(theirs, unnormalized, read_as=ARGS), theirs) > 0.1


def _loop_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its k experts one matmul at a time (what transformers does)."""
    logits, experts, weights = moe.router(x, moe.expert_bias)
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(moe.moe.top_k):
            e = experts[n, j]
            w1, w2, w3 = moe.experts.w1[e], moe.experts.w2[e], moe.experts.w3[e]
            h = torch.nn.functional.silu(x[n] @ w1.T) * (x[n] @ w3.T)
            out[n] += weights[n, j] * (h @ w2.T)
    return out


def test_grouped_gemms_equal_a_loop_over_experts_with_gradients():
    torch.manual_seed(0)
    moe = MoE(32, MoEArgs(num_experts=4, top_k=2, hidden_dim=16))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe.expert_bias.zero_()
    x = torch.randn(40, 32)
    fast, slow = moe(x), _loop_reference(moe, x)
    assert torch.allclose(fast, slow, atol=1e-5)
    grads = [torch.autograd.grad(out.square().sum(), list(moe.parameters())) for out in (moe(x), _loop_reference(moe, x))]
    for fast_grad, slow_grad in zip(*grads):
        assert torch.allclose(fast_grad, slow_grad, atol=1e-4)


@pytest.mark.parametrize("kind", ["swiglu", "clamped_swiglu"])
def test_experts_multiply_in_the_autocast_dtype(kind):
    """Autocast leaves torch._grouped_mm alone: without the experts' own cast a bf16-autocast model ran
    them in fp32 (on CUDA: the per-expert fallback). Their grouped GEMMs get bf16 operands and give what
    the same experts give on bf16 weights and inputs; gradients reach the fp32 weights."""
    torch.manual_seed(0)
    args = MoEArgs(num_experts=4, top_k=2, hidden_dim=16, expert_kind=kind)
    moe = MoE(32, args, gpt_oss_experts(32, args))  # the shared experts for swiglu, gpt-oss's clamped ones
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    seen, grouped_mm = [], moe.experts.grouped_mm

    def recording(a, b, offs):
        seen.append((a.dtype, b.dtype))
        return grouped_mm(a, b, offs=offs)

    moe.experts.grouped_mm = recording
    x = torch.randn(40, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(x)
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}
    order = torch.arange(40)
    counts = torch.tensor([10, 10, 10, 10])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routed = moe.experts(x[order], counts)
    bf16 = copy.deepcopy(moe.experts).to(torch.bfloat16)
    assert routed.dtype == torch.bfloat16 and torch.equal(routed, bf16(x[order].to(torch.bfloat16), counts))
    out.float().square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in moe.experts.parameters())


def test_expert_bias_moves_the_choice_not_the_weights():
    torch.manual_seed(0)
    moe = MoE(32, MoEArgs(num_experts=4, top_k=1, hidden_dim=16, score_func="sigmoid", norm_topk_prob=False))
    x = torch.randn(16, 32)
    moe.expert_bias.zero_()
    _, before, w_before = moe.router(x, moe.expert_bias)
    bias = torch.full((4,), -10.0)
    bias[3] = 10.0
    _, after, w_after = moe.router(x, bias)
    assert (after == 3).all() and not (before == 3).all()
    scores = torch.sigmoid(moe.router.gate(x))
    assert torch.allclose(w_after.squeeze(1), scores[:, 3])  # the weight is the unbiased score


"""MoE load balancing in one process: the sequence-wise auxiliary loss equals transformers'
load_balancing_loss_func where the two definitions meet (one sequence, one MoE layer) and adds exactly
its gradient; tokens are counted once per training forward, also under activation checkpointing; the
auxiliary-loss-free bias update moves toward the under-loaded experts; keys without MoE are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from titanctl.config.job_config import MoEBalancing
from titanctl.errors import ConfigError
from titanctl.models.common.args import MoEArgs
from titanctl.models.common.moe import MoE, sequence_aux_loss
from titanctl.models.llama.args import LLAMA3_FLAVORS
from titanctl.models.qwen3_moe.args import QWEN3_MOE_FLAVORS
from titanctl.parallel.layouts.dims import ParallelDims
from titanctl.train.moe_balance import MoEBalance, check_moe_keys, load_metrics

DIM = 32
ARGS = MoEArgs(num_experts=8, top_k=2, hidden_dim=16)


def moe(args: MoEArgs = ARGS) -> MoE:
    torch.manual_seed(0)
    layer = MoE(DIM, args)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=DIM**-0.5)
    layer.expert_bias.zero_()
    layer.tokens_per_expert.zero_()
    return layer


def test_aux_loss_equals_transformers_for_one_sequence_and_layer():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    layer = moe()
    x = torch.randn(1, 40, DIM, generator=torch.Generator().manual_seed(1))
    logits, experts, _ = layer.router(x[0], layer.expert_bias)
    ours = sequence_aux_loss(layer.router.probabilities(logits), experts, 1, ARGS.num_experts)
    theirs = load_balancing_loss_func((logits,), ARGS.num_experts, ARGS.top_k)
    assert torch.allclose(ours, theirs, rtol=1e-6), (ours, theirs)
    # Two sequences: the mean of each one's loss, not the loss of both pooled.
    x2 = torch.randn(2, 40, DIM, generator=torch.Generator().manual_seed(2))
    logits2, experts2, _ = layer.router(x2.reshape(-1, DIM), layer.expert_bias)
    both = sequence_aux_loss(layer.router.probabilities(logits2), experts2, 2, ARGS.num_experts)
    each = [load_balancing_loss_func((logits2[i * 40:(i + 1) * 40],), ARGS.num_experts, ARGS.top_k) for i in range(2)]
    assert torch.allclose(both, (each[0] + each[1]) / 2, rtol=1e-6)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_loss_adds_exactly_its_gradient(score_func):
    args = dataclasses.replace(ARGS, score_func=score_func)
    x = torch.randn(3, 16, DIM, generator=torch.Generator().manual_seed(3))
    plain, balanced = moe(args), moe(args)
    balanced.aux_loss_coef = 0.25
    plain(x).square().sum().backward()
    balanced(x).square().sum().backward()
    # The reference: the same objective written out, the auxiliary loss added to it directly.
    direct = moe(args)
    logits, experts, _ = direct.router(x.reshape(-1, DIM), direct.expert_bias)
    aux = sequence_aux_loss(direct.router.probabilities(logits), experts, 3, args.num_experts)
    (direct(x).square().sum() + 0.25 * aux).backward()
    for (name, p), r in zip(balanced.named_parameters(), direct.parameters()):
        assert (p.grad - r.grad).abs().max() <= 1e-5 * r.grad.abs().max(), name
    gate = "router.gate.weight"
    assert not torch.allclose(dict(balanced.named_parameters())[gate].grad, dict(plain.named_parameters())[gate].grad)


def test_tokens_are_counted_once_per_training_forward_also_when_recomputed():
    layer = moe()
    x = torch.randn(2, 24, DIM, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()  # forward, then forward again in backward
    assert layer.tokens_per_expert.sum().item() == 2 * 24 * ARGS.top_k
    with torch.no_grad():  # evaluation and generation count nothing
        layer(x)
    assert layer.tokens_per_expert.sum().item() == 2 * 24 * ARGS.top_k


def test_bias_update_moves_toward_underloaded_experts_and_resets_the_counts():
    layer = moe()
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"3": torch.nn.ModuleDict({"moe": layer})})})
    args = QWEN3_MOE_FLAVORS["debugmodel"]
    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, world_size=1)
    balance = MoEBalance([model], MoEBalancing(load_balance_coeff=0.01), args, dims, microbatches_per_step=1)
    layer.tokens_per_expert.copy_(torch.tensor([10.0, 0, 4, 4, 4, 4, 4, 2]))  # mean 4
    load = balance.after_step()
    assert torch.equal(load[3], torch.tensor([10.0, 0, 4, 4, 4, 4, 4, 2]))
    assert torch.allclose(layer.expert_bias, torch.tensor([-0.01, 0.01, 0, 0, 0, 0, 0, 0.01]))
    assert layer.tokens_per_expert.sum().item() == 0
    metrics = load_metrics(load)
    assert metrics["expert_imbalance"] == {"3": 2.5} and metrics["expert_imbalance_max"] == 2.5
    assert metrics["expert_load"]["3"] == [10, 0, 4, 4, 4, 4, 4, 2]


def test_balancing_keys_need_an_moe_model():
    with pytest.raises(ConfigError, match=r"moe.router_aux_loss_coef = 0.001 needs a Mixture-of-Experts model"):
        check_moe_keys(MoEBalancing(router_aux_loss_coef=0.001), LLAMA3_FLAVORS["debugmodel"], "llama3")
    check_moe_keys(MoEBalancing(), LLAMA3_FLAVORS["debugmodel"], "llama3")
    check_moe_keys(MoEBalancing(load_balance_coeff=1e-3), QWEN3_MOE_FLAVORS["debugmodel"], "qwen3_moe")

"""Qwen3.5's Gated DeltaNet split for tensor parallelism, in-process: the Hub's [all q | all k | all v]
rows (and conv channels) read into titanctl's per key-head group order and back bit for bit, a contiguous
half of them is exactly one group's q, k and value heads, the plan splits what it says, and head counts
that a degree does not divide are refused in one line (training and infer-tp). That TP 2 equals one
process is tests/distributed/test_hybrid_layouts.py's; infer-tp = transformers, test_infer_tp.py's."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from titanctl.checkpoint.hf.names import from_hf_tensor, to_hf_tensor
from titanctl.errors import ParallelError
from titanctl.inference.generate import check_tp_degree
from titanctl.models.qwen3_5.args import QWEN3_5_FLAVORS
from titanctl.models.qwen3_5_moe.args import QWEN3_5_MOE_FLAVORS
from titanctl.models.registry import spec_of
from titanctl.parallel.layouts.tensor_parallel import check_tp

ARGS = QWEN3_5_FLAVORS["debugmodel"].replace(vocab_size=512)  # 2 key heads of 32, each serving 2 value heads


@pytest.mark.parametrize("weight, trailing", [("attention.wqkv.weight", (256,)), ("attention.conv.weight", (1, 4))])
def test_hub_rows_read_per_key_head_group_and_back_bitwise(weight, trailing):
    la = ARGS.linear_attention
    dk, dv = la.key_head_dim, la.value_head_dim  # 32, 32: q, k, v rows of 2 x 32, 2 x 32, 4 x 32
    hub = torch.randn(la.conv_dim, *trailing)
    canonical, ours = from_hf_tensor(f"model.layers.0.linear_attn.{weight_hf(weight)}", hub, ARGS)
    assert canonical == f"layers.0.{weight}"
    q, k, v = hub.split([la.key_dim, la.key_dim, la.value_dim])
    group0 = torch.cat([q[:dk], k[:dk], v[: 2 * dv]])  # key head 0 and the value heads it serves
    assert torch.equal(ours.chunk(2)[0], group0)  # what TP rank 0 of 2 holds
    assert torch.equal(to_hf_tensor(canonical, ours, ARGS)[1], hub)


def weight_hf(name: str) -> str:
    return {"attention.wqkv.weight": "in_proj_qkv.weight", "attention.conv.weight": "conv1d.weight"}[name]


@pytest.mark.parametrize("args", [ARGS, QWEN3_5_MOE_FLAVORS["debugmodel"]], ids=["dense", "moe"])
def test_plan_splits_the_gated_deltanet_by_heads_and_keeps_its_norm_whole(args):
    plan = spec_of(args).tp_plan
    block = plan.block(args)
    for name in ("wqkv", "wz", "wb", "wa", "wq", "wk", "wv"):
        assert isinstance(block[f"attention.{name}"], ColwiseParallel), name
    assert isinstance(block["attention.out_proj"], RowwiseParallel)
    assert isinstance(block["attention.norm"], SequenceParallel)  # replicated weight, gradient summed
    assert set(plan.head_params) == {"attention.conv.weight", "attention.dt_bias", "attention.a_log"}
    assert ("moe" in block) == (args.moe is not None)


def test_key_heads_a_degree_does_not_divide_are_refused_in_one_line():
    args = ARGS.replace(n_kv_heads=4)  # attention heads 8 over 4 split 4 ways; the 2 key heads do not
    check_tp(args, 2, 64)
    with pytest.raises(ParallelError, match=r"^model linear_attention.num_key_heads = 2 is not divisible by "
                                            r"tensor_parallel_degree = 4$"):
        check_tp(args, 4, 64)
    with pytest.raises(ParallelError, match="linear_attention.num_key_heads = 2 is not divisible by the 4 processes"):
        check_tp_degree(args, 4)

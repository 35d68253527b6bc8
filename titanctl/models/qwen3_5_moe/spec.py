"""Qwen3.5-MoE's spec: Qwen3.5's hybrid blocks with a Mixture of Experts and a gated shared expert."""

from __future__ import annotations

from titanctl.models.common.decoder import split_into_stage
from titanctl.models.qwen3_5.blocks import BLOCKS, HYBRID_TP_PLAN
from titanctl.models.qwen3_5.flops import hybrid_flops_per_token
from titanctl.models.qwen3_5_moe.args import QWEN3_5_MOE_FLAVORS
from titanctl.models.qwen3_5_moe.hf import HF
from titanctl.models.spec import ModelSpec

SPEC = ModelSpec(
    name="qwen3_5_moe",
    flavors=QWEN3_5_MOE_FLAVORS,
    build=BLOCKS.build,
    tp_plan=HYBRID_TP_PLAN,
    split_stage=split_into_stage,
    flops_per_token=hybrid_flops_per_token,
    hf=HF,
    tokenizer_repo=("Qwen/Qwen3.5-35B-A3B", ""),
)

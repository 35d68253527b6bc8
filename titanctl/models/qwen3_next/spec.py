"""Qwen3-Next's spec: Qwen3.5-MoE's hybrid decoder with the fused Gated DeltaNet projections."""

from __future__ import annotations

from titanctl.models.common.decoder import split_into_stage
from titanctl.models.qwen3_5.flops import hybrid_flops_per_token
from titanctl.models.qwen3_next.args import QWEN3_NEXT_FLAVORS
from titanctl.models.qwen3_next.blocks import BLOCKS, FUSED_TP_PLAN
from titanctl.models.qwen3_next.hf import HF
from titanctl.models.spec import ModelSpec

SPEC = ModelSpec(
    name="qwen3_next",
    flavors=QWEN3_NEXT_FLAVORS,
    build=BLOCKS.build,
    tp_plan=FUSED_TP_PLAN,
    split_stage=split_into_stage,
    flops_per_token=hybrid_flops_per_token,
    hf=HF,
    tokenizer_repo=("Qwen/Qwen3-Next-80B-A3B-Instruct", ""),
)

"""Qwen3.5 (dense)'s spec: the shared decoder with Gated DeltaNet and gated full-attention blocks."""

from __future__ import annotations

from titanctl.models.common.decoder import split_into_stage
from titanctl.models.qwen3_5.args import QWEN3_5_FLAVORS
from titanctl.models.qwen3_5.blocks import BLOCKS, HYBRID_TP_PLAN
from titanctl.models.qwen3_5.flops import hybrid_flops_per_token
from titanctl.models.qwen3_5.hf import HF
from titanctl.models.spec import ModelSpec

SPEC = ModelSpec(
    name="qwen3_5",
    flavors=QWEN3_5_FLAVORS,
    build=BLOCKS.build,
    tp_plan=HYBRID_TP_PLAN,
    split_stage=split_into_stage,
    flops_per_token=hybrid_flops_per_token,
    hf=HF,
    tokenizer_repo=("Qwen/Qwen3.5-0.8B", ""),
)

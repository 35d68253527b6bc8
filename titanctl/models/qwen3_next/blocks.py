"""Qwen3-Next's blocks: Qwen3.5's hybrid blocks (gated full attention, the layer schedule, the shared
expert) with the fused Gated DeltaNet, and their tensor-parallel plan split by key-head groups."""

from __future__ import annotations

from titanctl.models.qwen3_5.blocks import hybrid_blocks, hybrid_tp_plan
from titanctl.models.qwen3_next.gated_deltanet import FusedGatedDeltaNet

BLOCKS = hybrid_blocks(FusedGatedDeltaNet)
# wqkvz and wba column-wise (whole key-head groups per rank, see gated_deltanet.py); the rest as Qwen3.5's.
FUSED_TP_PLAN = hybrid_tp_plan(("attention.wqkvz", "attention.wba"))

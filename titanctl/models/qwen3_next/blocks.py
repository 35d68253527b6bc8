"""Qwen3-Next's blocks: Qwen3.5's hybrid blocks (gated full attention, the layer schedule, the shared
expert) with the fused Gated DeltaNet, and their tensor-parallel plan split by key-head groups."""

from __future__ import annotations

from torch import nn

from titanctl.models.common.args import ModelArgs
from titanctl.models.common.decoder import Blocks
from titanctl.models.qwen3_5.attention import GatedAttention
from titanctl.models.qwen3_5.blocks import check_hybrid, hybrid_tp_plan
from titanctl.models.qwen3_next.gated_deltanet import FusedGatedDeltaNet


def mixer(args: ModelArgs, layer_id: int) -> nn.Module:
    check_hybrid(args)
    if args.is_linear_attention_layer(layer_id):
        return FusedGatedDeltaNet(args, layer_id)
    return GatedAttention(args, layer_id)


BLOCKS = Blocks(attention=mixer)
# wqkvz and wba column-wise (whole key-head groups per rank, see gated_deltanet.py); the rest as Qwen3.5's.
FUSED_TP_PLAN = hybrid_tp_plan(("attention.wqkvz", "attention.wba"))

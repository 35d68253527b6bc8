"""Qwen3-MoE's spec: the shared decoder with a Mixture of Experts in every block."""

from __future__ import annotations

from titanctl.models.common.decoder import Transformer, split_into_stage
from titanctl.models.common.flops import decoder_flops_per_token
from titanctl.models.common.torchtitan_names import GQA_LAYER_NAMES, MOE_LAYER_NAMES, TOP_NAMES
from titanctl.models.common.tp_plan import DECODER_TP_PLAN
from titanctl.models.qwen3_moe.args import QWEN3_MOE_FLAVORS
from titanctl.models.qwen3_moe.hf import HF
from titanctl.models.spec import ModelSpec, TorchtitanNames

SPEC = ModelSpec(
    name="qwen3_moe",
    flavors=QWEN3_MOE_FLAVORS,
    build=Transformer,
    tp_plan=DECODER_TP_PLAN,  # attention split; each MoE layer whole on every TP rank
    split_stage=split_into_stage,
    flops_per_token=decoder_flops_per_token,
    hf=HF,
    formats=("torchtitan",),
    torchtitan=TorchtitanNames(layer_names={**GQA_LAYER_NAMES, **MOE_LAYER_NAMES}, top_names=TOP_NAMES),
    tokenizer_repo=("Qwen/Qwen3-30B-A3B-Base", ""),
)

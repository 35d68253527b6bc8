"""Qwen3 (dense)'s spec: the shared decoder with per-head QK norm, in HF and torchtitan names."""

from __future__ import annotations

from titanctl.models.common.decoder import Transformer, split_into_stage
from titanctl.models.common.flops import decoder_flops_per_token
from titanctl.models.common.torchtitan_names import GQA_LAYER_NAMES, TOP_NAMES
from titanctl.models.common.tp_plan import DECODER_TP_PLAN
from titanctl.models.qwen3.args import QWEN3_FLAVORS
from titanctl.models.qwen3.hf import HF
from titanctl.models.spec import ModelSpec, TorchtitanNames

SPEC = ModelSpec(
    name="qwen3",
    flavors=QWEN3_FLAVORS,
    build=Transformer,
    tp_plan=DECODER_TP_PLAN,
    split_stage=split_into_stage,
    flops_per_token=decoder_flops_per_token,
    hf=HF,
    formats=("torchtitan",),
    torchtitan=TorchtitanNames(layer_names=GQA_LAYER_NAMES, top_names=TOP_NAMES),
    tokenizer_repo=("Qwen/Qwen3-0.6B-Base", ""),  # Base: documents end with <|endoftext|>
)

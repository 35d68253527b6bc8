"""Llama 3.x's spec: the shared decoder with Meta's layout, in every checkpoint format titanctl knows."""

from __future__ import annotations

from titanctl.models.common.decoder import Transformer, split_into_stage
from titanctl.models.common.flops import decoder_flops_per_token
from titanctl.models.common.torchtitan_names import GQA_LAYER_NAMES, TOP_NAMES
from titanctl.models.common.tp_plan import DECODER_TP_PLAN
from titanctl.models.llama.args import LLAMA3_FLAVORS
from titanctl.models.llama.hf import HF, TORCHTUNE_NAMES
from titanctl.models.spec import ModelSpec, TorchtitanNames

SPEC = ModelSpec(
    name="llama3",
    flavors=LLAMA3_FLAVORS,
    build=Transformer,
    tp_plan=DECODER_TP_PLAN,
    split_stage=split_into_stage,
    flops_per_token=decoder_flops_per_token,
    hf=HF,
    formats=("meta", "torchtune", "torchtitan"),
    torchtitan=TorchtitanNames(layer_names=GQA_LAYER_NAMES, top_names=TOP_NAMES),
    torchtune_names=TORCHTUNE_NAMES,
    tokenizer_repo=("meta-llama/Llama-3.1-8B", "original"),
)

"""DeepSeek-V3's spec: the shared decoder with Multi-head Latent Attention, dense first layers and a
Mixture of Experts (shared experts, group-limited routing) in the others."""

from __future__ import annotations

from titanctl.models.common.decoder import Transformer, split_into_stage
from titanctl.models.common.torchtitan_names import MOE_LAYER_NAMES, MTP_NAMES, TOP_NAMES
from titanctl.models.common.tp_plan import DECODER_TP_PLAN
from titanctl.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS
from titanctl.models.deepseek_v3.flops import deepseek_v3_flops_per_token
from titanctl.models.deepseek_v3.hf import HF
from titanctl.models.spec import ModelSpec, TorchtitanNames

SPEC = ModelSpec(
    name="deepseek_v3",
    flavors=DEEPSEEK_V3_FLAVORS,
    build=Transformer,
    tp_plan=DECODER_TP_PLAN,  # its block plan splits latent attention by heads (tp_plan.block_plan)
    split_stage=split_into_stage,
    flops_per_token=deepseek_v3_flops_per_token,
    hf=HF,
    formats=("torchtitan",),
    # Latent attention keeps titanctl's names in torchtitan (its wq too, unlike grouped-query attention's).
    torchtitan=TorchtitanNames(layer_names=MOE_LAYER_NAMES, top_names=TOP_NAMES, mtp_names=MTP_NAMES),
    tokenizer_repo=("deepseek-ai/DeepSeek-V3", ""),
)

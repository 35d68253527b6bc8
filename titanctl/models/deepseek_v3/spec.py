"""DeepSeek-V3's spec: the shared decoder with Multi-head Latent Attention, dense first layers, a
Mixture of Experts (shared experts, group-limited routing) in the others, and multi-token prediction."""

from __future__ import annotations

from torch import nn

from titanctl.models.common.args import ModelArgs
from titanctl.models.common.decoder import Blocks, grouped_query_attention, split_into_stage
from titanctl.models.common.torchtitan_names import MOE_LAYER_NAMES, TOP_NAMES
from titanctl.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS
from titanctl.models.deepseek_v3.flops import deepseek_v3_flops_per_token
from titanctl.models.deepseek_v3.hf import HF
from titanctl.models.deepseek_v3.mla import MultiHeadLatentAttention
from titanctl.models.deepseek_v3.mtp import MultiTokenPrediction
from titanctl.models.deepseek_v3.tp_plan import DEEPSEEK_V3_TP_PLAN
from titanctl.models.spec import ModelSpec, TorchtitanNames

# torchtitan 0.3.0's models/deepseek_v3: depth k is mtp_layers.{k}, one module holding the depth's block
# (titanctl's layers.{n_layers + k}) and its enorm/hnorm/eh_proj/mtp_norm (titanctl's mtp.{k}, whose
# norm is mtp_norm).
TORCHTITAN_MTP_NAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "mtp_norm.weight",
}


def attention(args: ModelArgs, layer_id: int) -> nn.Module:
    return MultiHeadLatentAttention(args) if args.mla is not None else grouped_query_attention(args, layer_id)


BLOCKS = Blocks(attention=attention, prediction_depth=MultiTokenPrediction)


SPEC = ModelSpec(
    name="deepseek_v3",
    flavors=DEEPSEEK_V3_FLAVORS,
    build=BLOCKS.build,
    tp_plan=DEEPSEEK_V3_TP_PLAN,
    split_stage=split_into_stage,
    flops_per_token=deepseek_v3_flops_per_token,
    hf=HF,
    formats=("torchtitan",),
    # Latent attention keeps titanctl's names in torchtitan (its wq too, unlike grouped-query attention's).
    torchtitan=TorchtitanNames(layer_names=MOE_LAYER_NAMES, top_names=TOP_NAMES, mtp_names=TORCHTITAN_MTP_NAMES),
    tokenizer_repo=("deepseek-ai/DeepSeek-V3", ""),
)

"""gpt-oss's spec: the shared decoder with attention biases, sinks and sliding-window layers, and a
Mixture of Experts of clamped-SwiGLU experts with biases in every block."""

from __future__ import annotations

from titanctl.models.common.decoder import Transformer, split_into_stage
from titanctl.models.common.flops import decoder_flops_per_token
from titanctl.models.common.torchtitan_names import GPT_OSS_EXPERT_NAMES, GQA_BIAS_NAMES, GQA_LAYER_NAMES, TOP_NAMES
from titanctl.models.common.tp_plan import DECODER_TP_PLAN
from titanctl.models.gpt_oss.args import GPT_OSS_FLAVORS
from titanctl.models.gpt_oss.hf import HF
from titanctl.models.spec import ModelSpec, TorchtitanNames

SPEC = ModelSpec(
    name="gpt_oss",
    flavors=GPT_OSS_FLAVORS,
    build=Transformer,
    # Attention split by heads (biases with their rows, sinks with their heads: tensor_parallel); each
    # MoE layer whole on every TP rank.
    tp_plan=DECODER_TP_PLAN,
    split_stage=split_into_stage,
    flops_per_token=decoder_flops_per_token,
    hf=HF,
    formats=("torchtitan",),
    torchtitan=TorchtitanNames(layer_names={**GQA_LAYER_NAMES, **GQA_BIAS_NAMES, **GPT_OSS_EXPERT_NAMES},
                               top_names=TOP_NAMES),
    tokenizer_repo=("openai/gpt-oss-20b", ""),
)

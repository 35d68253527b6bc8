"""gpt-oss's spec: the shared decoder with attention biases, sinks and sliding-window layers, and a
Mixture of Experts of clamped-SwiGLU experts with biases in every block."""

from __future__ import annotations

from torch import nn

from titanctl.models.common.args import ModelArgs
from titanctl.models.common.decoder import Blocks, grouped_query_attention, split_into_stage
from titanctl.models.common.flops import decoder_flops_per_token
from titanctl.models.common.torchtitan_names import EXPERT_BIAS_NAMES, GQA_BIAS_NAMES, GQA_LAYER_NAMES, TOP_NAMES
from titanctl.models.common.tp_plan import block_plan_of, root_plan
from titanctl.models.gpt_oss.args import GPT_OSS_FLAVORS
from titanctl.models.gpt_oss.attention import SinkAttention
from titanctl.models.gpt_oss.experts import experts
from titanctl.models.gpt_oss.hf import HF
from titanctl.models.spec import ModelSpec, TorchtitanNames, TPPlan

# torchtitan 0.3.0's models/gpt_oss: the experts are routed_experts.inner_experts, named with their
# shapes (mlp1_weight_EGD is titanctl's w13: gate and up rows interleaved, the same layout); sinks, wo
# and the router's gate (bias included) keep titanctl's names. (0.3.0's own Hugging Face adapter
# names them mlp1_weight etc., which its model does not have: checkpoints hold the model's names.)
TORCHTITAN_EXPERT_NAMES = {
    "moe.experts.w13": "moe.routed_experts.inner_experts.mlp1_weight_EGD",
    "moe.experts.b13": "moe.routed_experts.inner_experts.mlp1_bias_EG",
    "moe.experts.w2": "moe.routed_experts.inner_experts.mlp2_weight_EDF",
    "moe.experts.b2": "moe.routed_experts.inner_experts.mlp2_bias_ED",
    **EXPERT_BIAS_NAMES,
}


def attention(args: ModelArgs, layer_id: int) -> nn.Module:
    return SinkAttention(args, layer_id) if args.attention_sinks else grouped_query_attention(args, layer_id)


BLOCKS = Blocks(attention=attention, experts=experts)


SPEC = ModelSpec(
    name="gpt_oss",
    flavors=GPT_OSS_FLAVORS,
    build=BLOCKS.build,
    # Attention split by heads (biases with their rows, sinks with their heads); each MoE layer whole
    # on every TP rank.
    tp_plan=TPPlan(root=root_plan, block=block_plan_of, head_params=("attention.sinks",),
                   sequence_parallel_optional=True),
    split_stage=split_into_stage,
    flops_per_token=decoder_flops_per_token,
    hf=HF,
    formats=("torchtitan",),
    torchtitan=TorchtitanNames(layer_names={**GQA_LAYER_NAMES, **GQA_BIAS_NAMES, **TORCHTITAN_EXPERT_NAMES},
                               top_names=TOP_NAMES),
    tokenizer_repo=("openai/gpt-oss-20b", ""),
)

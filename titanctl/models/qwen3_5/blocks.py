"""The hybrid decoder's parts (Qwen3.5 dense and MoE): each block's token mixer by the layer schedule,
Gated DeltaNet or gated full attention, and what the rest of titanctl asks of such a model that differs
from a plain decoder (a tensor-parallel plan not yet built; FLOPs: ``flops``)."""

from __future__ import annotations

from torch import nn

from titanctl.errors import ConfigError
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.decoder import Blocks
from titanctl.models.common.gated_deltanet import GatedDeltaNet
from titanctl.models.common.tp_plan import root_plan
from titanctl.models.qwen3_5.attention import GatedAttention
from titanctl.models.spec import TPPlan


def check_hybrid(args: ModelArgs) -> None:
    """Refuse, in one line each, the hybrid args the blocks cannot build."""
    la = args.linear_attention
    if la is None:
        raise ValueError(f"ModelArgs of family {args.family!r} need linear_attention (the Gated DeltaNet's widths)")
    if len(args.layer_types) != args.n_layers:
        raise ValueError(f"ModelArgs.layer_types has {len(args.layer_types)} entries for {args.n_layers} layers")
    if la.conv_kernel < 1:
        raise ValueError(f"LinearAttentionArgs.conv_kernel is {la.conv_kernel}: the causal conv needs at least 1 tap")
    if la.num_value_heads % la.num_key_heads or args.n_heads % args.kv_heads:
        raise ValueError(f"head counts must divide: {la.num_key_heads} key heads into {la.num_value_heads} value "
                         f"heads, {args.kv_heads} KV heads into {args.n_heads} query heads")


def mixer(args: ModelArgs, layer_id: int) -> nn.Module:
    check_hybrid(args)
    if args.is_linear_attention_layer(layer_id):
        return GatedDeltaNet(args, layer_id)
    return GatedAttention(args, layer_id)


BLOCKS = Blocks(attention=mixer)


def _no_tensor_parallel(args, float8=None, float8_linears=()) -> dict:
    raise ConfigError(f"tensor parallelism is not built for {args.family}'s Gated DeltaNet layers yet; set "
                      "parallelism.tensor_parallel_degree = 1")


HYBRID_TP_PLAN = TPPlan(root=root_plan, block=_no_tensor_parallel)

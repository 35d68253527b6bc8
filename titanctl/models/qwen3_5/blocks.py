"""The hybrid decoder's parts (Qwen3.5 dense and MoE): each block's token mixer by the layer schedule,
Gated DeltaNet or gated full attention, and what the rest of titanctl asks of such a model that differs
from a plain decoder (the tensor-parallel plan; FLOPs: ``flops``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from titanctl.models.common.args import ModelArgs
from titanctl.models.common.decoder import Blocks
from titanctl.models.common.gated_deltanet import GatedDeltaNet
from titanctl.models.common.tp_plan import LinearStyles, block_plan, gqa_attention_plan, root_plan
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


def hybrid_blocks(linear_attention: type[nn.Module]) -> Blocks:
    """Blocks whose token mixer follows the layer schedule: ``linear_attention`` (a Gated DeltaNet) or the
    gated full attention."""

    def mixer(args: ModelArgs, layer_id: int) -> nn.Module:
        check_hybrid(args)
        if args.is_linear_attention_layer(layer_id):
            return linear_attention(args, layer_id)
        return GatedAttention(args, layer_id)

    return Blocks(attention=mixer)


BLOCKS = hybrid_blocks(GatedDeltaNet)


GATED_DELTANET_LINEARS = ("attention.wqkv", "attention.wz", "attention.wb", "attention.wa")


def hybrid_attention_plan(styles: Callable[..., LinearStyles],
                          linears: tuple[str, ...] = GATED_DELTANET_LINEARS) -> dict[str, ParallelStyle]:
    """Both token mixers split by heads; a block has one of them, and the plan's entries for the other's
    modules find nothing in it.

    Gated full attention: the shared GQA plan. ``wq`` holds each head's query rows then its gate rows, so a
    contiguous split by rows still gives each rank whole heads with their gates.
    Gated DeltaNet: ``wqkv`` (stored per key-head group, see gated_deltanet.py), ``wz``, ``wb`` and ``wa``
    column-wise, so each rank holds whole key-head groups and their value heads; ``out_proj`` row-wise.
    The conv's channels, ``dt_bias`` and ``a_log`` split with them (``HYBRID_TP_PLAN.head_params``). The
    gated norm's weight (one value head's width, shared by every head) stays whole on every rank, its
    gradient summed over the ranks' heads, as QK norm's is (``block_plan``). ``linears``: the Gated
    DeltaNet's input projections, each stored per key-head group or per value head (a fused variant's)."""
    plan = gqa_attention_plan(styles)
    # The block passes (hidden, rope) to either mixer: gather the hidden states, leave the rope table alone.
    plan["attention"] = styles("attention.wq", "attention.wk", "attention.wv", *linears).prepare_input(
        input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
    for name in linears:
        plan[name] = styles(name).colwise()
    plan["attention.out_proj"] = styles("attention.out_proj").rowwise(output_layouts=Shard(1))
    plan["attention.norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def hybrid_block_plan(args: ModelArgs, float8: LinearStyles | None = None,
                      float8_linears: Collection[str] = (),
                      linears: tuple[str, ...] = GATED_DELTANET_LINEARS) -> dict[str, ParallelStyle]:
    return block_plan(float8, float8_linears, qk_norm=True, moe=args.moe is not None,
                      attention=functools.partial(hybrid_attention_plan, linears=linears))


def hybrid_tp_plan(linears: tuple[str, ...] = GATED_DELTANET_LINEARS) -> TPPlan:
    """The hybrid decoder's plan, its Gated DeltaNet's input projections named by ``linears``."""
    return TPPlan(root=root_plan, block=functools.partial(hybrid_block_plan, linears=linears),
                  head_params=("attention.conv.weight", "attention.dt_bias", "attention.a_log"))


HYBRID_TP_PLAN = hybrid_tp_plan()

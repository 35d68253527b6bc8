"""DeepSeek-V3's tensor-parallel plan: the shared decoder's, with latent attention split by heads and
the prediction depths on each rank's part of the sequence."""

from __future__ import annotations

from collections.abc import Callable, Collection

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from titanctl.models.common.tp_plan import PLAIN, LinearStyles, block_plan, gqa_attention_plan, root_plan
from titanctl.models.spec import TPPlan

# Multi-head Latent Attention's modules that tensor parallel leaves whole on every rank: the low-rank
# projections into the latents and their norms, small next to the per-head expansions (wq_b, wkv_b),
# whose outputs every head needs. Their gradients are whole on every rank too: the split linears
# after them sum their inputs' gradients over the ranks (as any column-wise linear does), and the one
# slice of wkv_a's output that reaches the heads without such a linear (the shared rotary key,
# ``attention.shared_rope_key``) is summed over the ranks.
MLA_REPLICATED = ("attention.wq_a", "attention.q_norm", "attention.wkv_a", "attention.kv_norm")


def mla_attention_plan(styles: Callable[..., LinearStyles]) -> dict[str, ParallelStyle]:
    return {
        # The latent projections (wq_a, wkv_a) and their norms run whole on every rank (see
        # MLA_REPLICATED) on the gathered sequence, a local tensor like every activation inside.
        "attention": PLAIN.prepare_input(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_output=True
        ),
        # Split by heads: a query head is qk_head_dim rows of wq / wq_b, a key-and-value head
        # nope + v rows of wkv_b, in head order, so each rank's rows are whole heads.
        "attention.wq": styles("attention.wq").colwise(),
        "attention.wq_b": styles("attention.wq_b").colwise(),
        "attention.wkv_b": styles("attention.wkv_b").colwise(),
        "attention.wo": styles("attention.wo").rowwise(output_layouts=Shard(1)),
    }


def _block(args, float8: LinearStyles | None = None, float8_linears: Collection[str] = ()) -> dict[str, ParallelStyle]:
    attention = mla_attention_plan if args.mla is not None else gqa_attention_plan
    return block_plan(float8, float8_linears, qk_norm=args.qk_norm, moe=args.moe is not None, attention=attention)


def mtp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The prediction depths (``model.mtp``): norms and the projection run on this rank's part of the
    sequence (replicated weights whose gradients sum over the ranks' parts); the projection hands its
    block a local tensor, as the embedding does."""
    plan = {}
    for k in model.mtp or {}:
        plan |= {f"mtp.{k}.hnorm": SequenceParallel(), f"mtp.{k}.enorm": SequenceParallel(),
                 f"mtp.{k}.norm": SequenceParallel(), f"mtp.{k}.eh_proj": SequenceParallel(use_local_output=True)}
    return plan


def _block_inputs(model: nn.Module) -> list[str]:
    return ["tok_embeddings", *(f"mtp.{k}.eh_proj" for k in model.mtp or {})]


DEEPSEEK_V3_TP_PLAN = TPPlan(root=root_plan, block=_block, extra=mtp_plan, block_inputs=_block_inputs,
                             replicated=MLA_REPLICATED, summed_gradient=("attention.shared_rope_key",))

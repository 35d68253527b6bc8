"""The shared decoder's tensor-parallel plan: module name -> parallel style.

Sequence parallel keeps activations sharded on the sequence dim (Shard(1)) between
blocks and around the norms; attention and the MLP gather the sequence, shard heads /
hidden units (colwise in, rowwise out) and scatter back. With loss parallel the output
layer leaves logits sharded on the vocabulary and the loss is computed on the shards.

Without sequence parallel (``sequence_parallel=False``: a decode step's one token cannot be split
over the ranks) activations stay whole on every rank between blocks: the norms run whole
(``_torch_compat.replicated_style``), each row-wise linear all-reduces its partial sums, the embedding all-reduces its
vocabulary shards' lookups and the output layer all-gathers the logits.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from titanctl._torch_compat import replicated_style
from titanctl.models.spec import TPPlan


@dataclass(frozen=True)
class LinearStyles:
    """The styles of a block's linears and of the modules that gather their input.

    Float8 training passes torchao's float8 styles, which cast to float8 before communicating
    (the all-gather of activations moves float8); the plan stays the same.
    """

    colwise: type[ColwiseParallel] = ColwiseParallel
    rowwise: type[RowwiseParallel] = RowwiseParallel
    prepare_input: type[PrepareModuleInput] = PrepareModuleInput


PLAIN = LinearStyles()


def root_plan(loss_parallel: bool, sequence_parallel: bool = True) -> dict[str, ParallelStyle]:
    if not sequence_parallel:  # loss parallel needs sharded logits: the output layer gathers them whole
        return {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "norm": replicated_style(),
            "output": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        }
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }


def gqa_attention_plan(styles: Callable[..., LinearStyles]) -> dict[str, ParallelStyle]:
    """Grouped-query attention split by heads: q/k/v column-wise, wo row-wise. ``styles(*linears)``:
    the styles for those linears (see ``block_plan``)."""
    return {
        # The block passes (hidden, rope): gather the hidden states, leave the rope table alone.
        "attention": styles("attention.wq", "attention.wk", "attention.wv").prepare_input(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": styles("attention.wq").colwise(),
        "attention.wk": styles("attention.wk").colwise(),
        "attention.wv": styles("attention.wv").colwise(),
        "attention.wo": styles("attention.wo").rowwise(output_layouts=Shard(1)),
    }


def block_plan(
    float8: LinearStyles | None = None,
    float8_linears: Collection[str] = (),
    qk_norm: bool = False,
    moe: bool = False,
    attention: Callable[[Callable[..., LinearStyles]], dict[str, ParallelStyle]] = gqa_attention_plan,
    sequence_parallel: bool = True,
) -> dict[str, ParallelStyle]:
    """The plan of one block. ``float8``: the styles for the linears named in ``float8_linears``
    (names inside the block, e.g. attention.wq); the others, and a gather feeding any of them,
    keep the plain styles (a float8 input would reach a high-precision linear).
    ``qk_norm``: the block has per-head ``attention.q_norm`` / ``k_norm`` (ModelArgs.qk_norm).
    ``moe``: the model has Mixture-of-Experts blocks (a block gets the entries of what it has:
    ``feed_forward`` or ``moe``). ``attention``: the attention's entries, from the styles function
    (a family whose attention is another module gives its own). ``sequence_parallel=False``: activations
    whole between the linears (see the module docstring)."""

    def styles(*linears: str) -> LinearStyles:
        return float8 if float8 is not None and all(n in float8_linears for n in linears) else PLAIN

    plan = {
        "attention_norm": SequenceParallel(),
        **attention(styles),
        "ffn_norm": SequenceParallel(),
        "feed_forward": styles("feed_forward.w1", "feed_forward.w3").prepare_input(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": styles("feed_forward.w1").colwise(),
        "feed_forward.w2": styles("feed_forward.w2").rowwise(output_layouts=Shard(1)),
        "feed_forward.w3": styles("feed_forward.w3").colwise(),
    }
    if not sequence_parallel:
        # The gathers of the sequence go, the norms run whole, the row-wise linears all-reduce (their
        # default output, Replicate); a Mixture-of-Experts block already runs whole on every rank.
        plan = {name: style for name, style in plan.items() if name.endswith((".w1", ".w2", ".w3", ".wq", ".wk",
                                                                              ".wv", ".wo"))}
        plan = {name: styles(name).rowwise() if isinstance(style, RowwiseParallel) else style
                for name, style in plan.items()}
        plan |= {"attention_norm": replicated_style(), "ffn_norm": replicated_style()}
    if qk_norm:
        # The norm weight (head_dim) is shared by all heads while each rank holds only its heads:
        # keep it whole (Replicate) and see the local (B, T, H/tp, head_dim) tensor as sharded on
        # dim 2, so the weight's gradient is summed over every rank's heads. Local in, local out.
        for name in ("attention.q_norm", "attention.k_norm"):
            plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if moe and sequence_parallel:
        # A Mixture-of-Experts block (in place of feed_forward): nothing in it is split. Every rank
        # of the TP group runs the whole layer on the gathered sequence, so each holds the full
        # gradient of the router and of every expert (nothing to reduce over tp, nothing
        # under-reduced), then keeps its own part of the sequence. Its weights are replicated over
        # TP by titanctl.parallel.layouts (tensor_parallel, and expert_parallel for the experts).
        plan["moe"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True,
        )
    return plan


def sharded_linear_dims(name: str, tp: int, plan: TPPlan, args) -> tuple[int, int]:
    """How many ways the family's ``plan`` splits the (out, in) dims of the linear ``name``
    (canonical, e.g. layers.3.attention.wo or output): colwise splits out, rowwise splits in."""
    if tp == 1:
        return 1, 1
    in_block = re.fullmatch(r"layers\.\d+\.(.+)", name)
    style = plan.block(args).get(in_block.group(1)) if in_block else plan.root(True).get(name)
    if isinstance(style, ColwiseParallel):
        return tp, 1
    if isinstance(style, RowwiseParallel):
        return 1, tp
    return 1, 1


def block_plan_of(
    args, float8: LinearStyles | None = None, float8_linears: Collection[str] = (), sequence_parallel: bool = True
) -> dict[str, ParallelStyle]:
    """``block_plan`` for the blocks ``args`` build (``TPPlan.block``)."""
    return block_plan(float8, float8_linears, qk_norm=args.qk_norm, moe=args.moe is not None,
                      sequence_parallel=sequence_parallel)


DECODER_TP_PLAN = TPPlan(root=root_plan, block=block_plan_of, sequence_parallel_optional=True)

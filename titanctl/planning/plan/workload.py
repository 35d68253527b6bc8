"""What one block of a model is made of, as the cost and memory models need it: its matmuls, with how
tensor parallel splits each, its routed experts, and its other parameters.

Read off the model itself: the weight shapes (``titanctl.models.shapes``, the meta-device model) and
the family's tensor-parallel plan (``spec.tp_plan``, the same data ``apply_tp`` applies). A linear the
plan marks column-wise has its output features split tp ways, row-wise its input features; anything
else (norms, MoE routers, latent-attention down-projections, every MoE layer's experts: tensor
parallel runs MoE layers whole on each TP rank) is whole on every TP rank. The plan's ``head_params``
are split with the query heads on dim 0, as ``apply_tp`` splits them: a linear's weight among them
(DeepSeek-V4's grouped output projection ``o_a_proj``, a rank holding whole head groups) counts as
column-wise, any other (sinks) tp ways. Routed experts are split over the expert-parallel ranks. A Gated
DeltaNet block also names its delta rule's widths (``delta_rule``), whose saved tensors are no linear's; a
block whose attention materializes its scores (``spec.attention_scores``: DeepSeek-V4's) names their count
per token (``attention_scores``).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from titanctl.models.common.args import ModelArgs


@dataclass(frozen=True)
class Linear:
    name: str  # inside the block, e.g. attention.wq
    out_features: int
    in_features: int
    split: str  # "col", "row" or "" (whole on every TP rank)

    def local(self, tp: int) -> tuple[int, int]:
        """(out, in) features on one TP rank."""
        if self.split == "col":
            return self.out_features // tp, self.in_features
        if self.split == "row":
            return self.out_features, self.in_features // tp
        return self.out_features, self.in_features


@dataclass(frozen=True)
class Experts:
    count: int
    top_k: int
    matrices: tuple[tuple[int, int], ...]  # (out, in) of each expert's matrices (w1, w2, w3; gpt-oss: w13, w2)
    biases: int = 0  # each expert's bias values (gpt-oss: b13 and b2)

    @property
    def params_per_expert(self) -> int:
        return sum(o * i for o, i in self.matrices) + self.biases


@dataclass(frozen=True)
class Block:
    linears: tuple[Linear, ...]  # dense matmuls (shared experts and routers included)
    experts: Experts | None  # the routed experts (MoE blocks)
    other_params: int  # norms and biases: whole on every rank
    moe_linears: tuple[Linear, ...]  # the linears of the MoE layer (router, shared experts): whole under TP
    # A Gated DeltaNet block's heads and widths: (key heads, value heads, key width, value width), else None.
    delta_rule: tuple[int, int, int, int] | None = None
    # Elements per query token of the attention scores the block materializes (heads x keys); 0: a fused kernel.
    attention_scores: int = 0
    # The same on a rank of context parallel degree cp (``spec.attention_scores`` of the block's layer).
    scores_under_cp: Callable[[int], int] | None = field(default=None, compare=False)
    # Parameters other than linears' weights that hold one value per query head (sinks): split tp ways.
    head_split_params: int = 0

    def scores(self, cp: int) -> int:
        """``attention_scores`` on a rank of context parallel degree ``cp``."""
        return self.attention_scores if cp == 1 or self.scores_under_cp is None else self.scores_under_cp(cp)

    def params(self, tp: int, ep: int) -> int:
        """Parameters of this block on one rank of a tp x ep layout (before FSDP sharding)."""
        dense = sum(math.prod(lin.local(tp)) for lin in self.linears)
        routed = 0 if self.experts is None else self.experts.count // ep * self.experts.params_per_expert
        return dense + routed + self.other_params + self.head_split_params // tp

    def expert_params(self, ep: int) -> int:
        return 0 if self.experts is None else self.experts.count // ep * self.experts.params_per_expert


@dataclass(frozen=True)
class ModelShape:
    args: ModelArgs
    blocks: tuple[Block, ...]
    vocab: int
    dim: int
    embedding_params: int
    output_params: int  # 0 when tied to the embedding
    final_norm_params: int

    @property
    def n_layers(self) -> int:
        return len(self.blocks)


@functools.lru_cache(maxsize=16)
def model_shape(args: ModelArgs) -> ModelShape:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from titanctl.models.registry import spec_of
    from titanctl.models.shapes import integer_state, tied_weights, weight_shapes

    shapes = weight_shapes(args)
    integers = integer_state(args)  # token -> experts tables
    buffers_or_tied = set(tied_weights(args))
    spec = spec_of(args)
    plan = spec.tp_plan.block(args, None, ())
    split = {name: "col" if isinstance(style, ColwiseParallel) else "row" if isinstance(style, RowwiseParallel) else ""
             for name, style in plan.items()}
    # A weight the plan splits with the query heads (dim 0: its output rows, e.g. DeepSeek-V4's grouped
    # output projection ``o_a_proj``, a rank holding whole head groups) is column-split as the real plan does.
    head_params = set(spec.tp_plan.head_params)
    split.update({name.removesuffix(".weight"): "col" for name in head_params if name.endswith(".weight")})
    per_layer: dict[int, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        match = re.match(r"layers\.(\d+)\.(.+)$", key)
        if match:
            per_layer.setdefault(int(match.group(1)), {})[match.group(2)] = shape
    blocks = []
    for layer in range(args.n_layers):
        linears, moe_linears, other, experts, expert_biases, head_split = [], [], 0, [], 0, 0
        for name, shape in per_layer[layer].items():
            if name.endswith("expert_bias") or f"layers.{layer}.{name}" in integers:  # buffers, no parameters
                continue
            module = name.removesuffix(".weight")
            if ".experts." in name and len(shape) == 3:
                experts.append((shape[1], shape[2]))
                count = shape[0]
            elif ".experts." in name and len(shape) == 2:  # (E, width): a bias per expert, split with them
                expert_biases += shape[1]
            elif len(shape) == 2:
                lin = Linear(module, shape[0], shape[1], split.get(module, ""))
                (moe_linears if module.startswith("moe.") else linears).append(lin)
            elif name in head_params:  # one value per query head (sinks): split with the heads
                head_split += math.prod(shape)
            else:
                other += math.prod(shape)
        routed = None
        if experts:
            routed = Experts(count, args.moe.top_k, tuple(experts), expert_biases)
        la = args.linear_attention
        rule = ((la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim)
                if la is not None and args.is_linear_attention_layer(layer) else None)
        blocks.append(Block(tuple(linears + moe_linears), routed, other, tuple(moe_linears), rule,
                            spec.attention_scores(args, layer), functools.partial(spec.attention_scores, args, layer),
                            head_split))
    vocab, dim = shapes["tok_embeddings.weight"]
    tied = "output.weight" in buffers_or_tied
    return ModelShape(
        args, tuple(blocks), vocab, dim, vocab * dim, 0 if tied else math.prod(shapes["output.weight"]),
        math.prod(shapes["norm.weight"]),
    )

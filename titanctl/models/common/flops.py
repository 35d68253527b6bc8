"""Training FLOPs per token of a dense decoder."""

from __future__ import annotations

import math

from titanctl.models.common.args import ModelArgs
from titanctl.models.shapes import num_params, weight_shapes


def decoder_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """6N for the matmuls of the N active parameters outside the embedding table (forward 2N, backward
    4N; the output layer counts), plus 12·L·H·Q·T for attention scores and values (4·T·Q per head
    and layer forward, 3x with backward; causal masking halves the work actually done, which this
    formula, like torchtitan's, does not credit)."""
    return 6 * active_params(args) + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


def active_params(args: ModelArgs) -> int:
    """Parameters a token's matmuls use: all but the embedding lookup and, in MoE layers, the
    routed experts it is not sent to (an expert's share of its layer's stacked expert weights)."""
    n = num_params(args, include_embedding=False)
    moe = args.moe
    if moe is not None:
        layers = [i for i in range(args.n_layers + args.mtp_layers) if args.is_moe_layer(i)]
        if layers:
            prefix = f"layers.{layers[0]}.moe.experts."
            stacked = sum(math.prod(shape) for name, shape in weight_shapes(args).items() if name.startswith(prefix))
            n -= len(layers) * stacked // moe.num_experts * (moe.num_experts - moe.top_k)
    return n

"""Training FLOPs per token of a dense decoder."""

from __future__ import annotations

from titanctl.models.common.args import ModelArgs
from titanctl.models.shapes import num_params


def decoder_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """6N for the matmuls of the N parameters outside the embedding table (forward 2N, backward
    4N; the output layer counts), plus 12·L·H·Q·T for attention scores and values (4·T·Q per head
    and layer forward, 3x with backward; causal masking halves the work actually done, which this
    formula, like torchtitan's, does not credit)."""
    n = num_params(args, include_embedding=False)
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len

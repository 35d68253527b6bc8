"""Training FLOPs per token of the hybrid decoder (Qwen3.5 dense and MoE): the matmuls of its active
parameters, full attention's scores in its full-attention layers, and the chunked gated delta rule's
products in its Gated DeltaNet layers.

Per value head and token, the chunked rule (``models/common/gated_delta_rule.py``, chunks of C tokens,
keys of d_k and values of d_v) multiplies, forward: within its chunk, k_beta·kᵀ and q·kᵀ (2·C·d_k
each), the two unit-triangular solves for u and w (C·d_v and C·d_k: half a C x C matrix times d_v or d_k
columns), the scores times the deltas (2·C·d_v); against the chunk's starting state, w·S, q·S and the
state update kᵀ·delta (2·d_k·d_v each). That is C·(5·d_k + 3·d_v) + 6·d_k·d_v; backward twice that, as
for any matmul: 3x in all. The short causal conv and the projections are parameters (a depthwise conv
of kernel K does 2·K FLOPs per channel and token: 2 per parameter, as a matmul), counted in 6N.
"""

from __future__ import annotations

from titanctl.models.common.args import ModelArgs
from titanctl.models.common.flops import active_params

CHUNK = 64  # chunk_gated_delta_rule's chunk, as Gated DeltaNet calls it in training


def gated_delta_rule_flops_per_token(args: ModelArgs) -> float:
    """Forward + backward FLOPs of one Gated DeltaNet layer's chunked rule, per token."""
    la = args.linear_attention
    dk, dv = la.key_head_dim, la.value_head_dim
    return 3 * la.num_value_heads * (CHUNK * (5 * dk + 3 * dv) + 6 * dk * dv)


def hybrid_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """6N for the matmuls of the N active parameters; 12·H·Q·T in each full-attention layer (as
    ``decoder_flops_per_token``); ``gated_delta_rule_flops_per_token`` in each Gated DeltaNet layer."""
    linear = sum(args.is_linear_attention_layer(i) for i in range(args.n_layers))
    full = args.n_layers - linear
    return (6 * active_params(args) + 12 * full * args.n_heads * args.head_dim * seq_len
            + linear * gated_delta_rule_flops_per_token(args))

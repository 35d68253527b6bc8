"""Training FLOPs per token of DeepSeek-V3 (Multi-head Latent Attention, routed experts)."""

from __future__ import annotations

from titanctl.models.common.args import ModelArgs
from titanctl.models.common.flops import active_params


def deepseek_v3_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """6N for the matmuls of the N active parameters (read off the model's weights, so MLA's latent
    projections count as they are, and MoE layers count only a token's top_k routed experts), plus
    attention: per head and layer, 2·T·qk_head_dim for the scores and 2·T·v_head_dim for the weighted
    values forward, 3x with backward (the values are narrower than queries and keys, so the dense
    decoder's 12·L·H·head_dim·T would overcount). Each multi-token-prediction depth adds its block and
    projection (in the active parameters) and another pass through the shared output layer."""
    mla = args.mla
    blocks = args.n_layers + args.mtp_layers
    shared_output = args.mtp_layers * args.dim * args.vocab_size
    return (6 * (active_params(args) + shared_output)
            + 6 * blocks * args.n_heads * (mla.qk_head_dim + mla.v_head_dim) * seq_len)

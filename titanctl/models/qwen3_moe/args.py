"""Qwen3-MoE flavors: Qwen3 with every block's FFN a softmax top-k router over routed experts
(renormalized top-k weights, no shared experts).

Published dimensions: the ``config.json`` of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B on Hugging
Face (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim 128,
moe_intermediate_size, num_experts 128, num_experts_per_tok 8, norm_topk_prob true, rope_theta 1e6,
rms_norm_eps 1e-6, vocab 151936, untied, every layer sparse).
"""

from __future__ import annotations

from titanctl.models.common.args import ModelArgs, MoEArgs
from titanctl.models.qwen3.args import QWEN3_VOCAB_SIZE, qwen3_args


def qwen3_moe_args(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, experts: int, top_k: int,
                   expert_ffn: int, head_dim: int = 128, vocab_size: int = QWEN3_VOCAB_SIZE) -> ModelArgs:
    dense = qwen3_args(dim, n_layers, n_heads, n_kv_heads, ffn=expert_ffn, tied=False, head_dim=head_dim,
                       vocab_size=vocab_size)
    return dense.replace(family="qwen3_moe", moe=MoEArgs(num_experts=experts, top_k=top_k, hidden_dim=expert_ffn))


QWEN3_MOE_FLAVORS: dict[str, ModelArgs] = {
    # CPU-sized: 8 experts of 128, top-2 (8.9M parameters with the bundled tokenizer; 4.3M active outside
    # the embedding).
    "debugmodel": qwen3_moe_args(dim=256, n_layers=6, n_heads=16, n_kv_heads=4, experts=8, top_k=2,
                                 expert_ffn=128, head_dim=32, vocab_size=-1),
    "30B-A3B": qwen3_moe_args(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, experts=128, top_k=8, expert_ffn=768),
    "235B-A22B": qwen3_moe_args(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, experts=128, top_k=8,
                                expert_ffn=1536),
}

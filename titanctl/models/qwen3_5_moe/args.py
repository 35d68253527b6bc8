"""Qwen3.5-MoE flavors: Qwen3.5 with every block's FFN a softmax top-k router over routed experts
(renormalized top-k weights) beside one shared expert whose output sigmoid(a learned linear) scales.

Published dimensions: Qwen/Qwen3.5-35B-A3B (hidden 2048, 40 layers, 16 heads of 256 over 2 KV heads, RoPE
on a quarter of each head, theta 1e7, Gated DeltaNet 16 key heads and 32 value heads of 128, conv 4, 256
experts of 512 with top-8 and a shared expert of 512, vocab 248320, untied), as read from slime's
Megatron recipe of that checkpoint (scripts/models/qwen3.5-35B-A3B.sh); the Hub's config.json was not
reachable here, but transformers 5.23's ``Qwen3_5MoeTextConfig`` defaults (documented as that checkpoint's)
are the same shape. Qwen/Qwen3.5-397B-A17B: hidden 4096, 60 layers (every fourth full attention), 32 heads
of 256 over 2 KV heads, Gated DeltaNet 16 key heads and 64 value heads of 128, conv 4, 512 experts of 1024
with top-10 and a shared expert of 1024, vocab 248320, untied (its GGUF metadata as llama.cpp users
printed it, and a planner's copy of its config.json, in public issue threads).
"""

from __future__ import annotations

from titanctl.models.common.args import LinearAttentionArgs, ModelArgs, MoEArgs
from titanctl.models.qwen3_5.args import DEBUG_LINEAR, QWEN3_5_VOCAB_SIZE, qwen3_5_args


def qwen3_5_moe_args(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, experts: int, top_k: int,
                     expert_ffn: int, linear: LinearAttentionArgs, head_dim: int = 256,
                     vocab_size: int = QWEN3_5_VOCAB_SIZE) -> ModelArgs:
    dense = qwen3_5_args(dim, n_layers, n_heads, n_kv_heads, ffn=expert_ffn, tied=False, linear=linear,
                         head_dim=head_dim, vocab_size=vocab_size)
    moe = MoEArgs(num_experts=experts, top_k=top_k, hidden_dim=expert_ffn, num_shared_experts=1,
                  shared_expert_gate=True)
    return dense.replace(family="qwen3_5_moe", moe=moe)


QWEN3_5_MOE_FLAVORS: dict[str, ModelArgs] = {
    # CPU-sized: 8 experts of 128, top-2, a shared expert of 128.
    "debugmodel": qwen3_5_moe_args(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, experts=8, top_k=2,
                                   expert_ffn=128, linear=DEBUG_LINEAR, head_dim=32, vocab_size=-1),
    "35B-A3B": qwen3_5_moe_args(dim=2048, n_layers=40, n_heads=16, n_kv_heads=2, experts=256, top_k=8,
                                expert_ffn=512,
                                linear=LinearAttentionArgs(num_key_heads=16, num_value_heads=32, key_head_dim=128,
                                                           value_head_dim=128)),
    "397B-A17B": qwen3_5_moe_args(dim=4096, n_layers=60, n_heads=32, n_kv_heads=2, experts=512, top_k=10,
                                  expert_ffn=1024,
                                  linear=LinearAttentionArgs(num_key_heads=16, num_value_heads=64, key_head_dim=128,
                                                             value_head_dim=128)),
}

"""Qwen3-Next flavors: Qwen3.5-MoE's shape of model (the same ModelArgs switches: the layer schedule,
partial RoPE, the gated full attention, zero-centred norms, a softmax top-k router beside a gated shared
expert) with Qwen3's tokenizer and the first ``moe.first_dense_layers`` blocks optionally dense.

Published dimensions: Qwen/Qwen3-Next-80B-A3B (hidden 2048, 48 layers, every fourth full attention, 16
heads of 256 over 2 KV heads, RoPE on a quarter of each head, theta 1e7, Gated DeltaNet 16 key heads and 32
value heads of 128, conv 4, 512 experts of 512 with top-10 and a shared expert of 512, every layer MoE,
dense width 5120 unused, vocab 151936, untied, eps 1e-6): transformers 5.23's ``Qwen3NextConfig``
defaults, documented as that checkpoint's, but for theta (its default 1e4), the dense width (5632) and
the context (32768), which are the release's config.json values (rope_theta 1e7, intermediate_size 5120,
max_position_embeddings 262144) as public copies of it give them; the Hub was not reachable here.
"""

from __future__ import annotations

from titanctl.models.common.args import LinearAttentionArgs, ModelArgs
from titanctl.models.qwen3_5.args import DEBUG_LINEAR
from titanctl.models.qwen3_5_moe.args import qwen3_5_moe_args

QWEN3_VOCAB_SIZE = 151936  # Qwen3's tokenizer, as Qwen3-Next's embedding rows


def qwen3_next_args(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, experts: int, top_k: int,
                    expert_ffn: int, dense_ffn: int, linear: LinearAttentionArgs, head_dim: int = 256,
                    vocab_size: int = QWEN3_VOCAB_SIZE) -> ModelArgs:
    args = qwen3_5_moe_args(dim, n_layers, n_heads, n_kv_heads, experts, top_k, expert_ffn, linear,
                            head_dim=head_dim, vocab_size=vocab_size)
    return args.replace(family="qwen3_next", explicit_ffn_hidden_dim=dense_ffn)


QWEN3_NEXT_FLAVORS: dict[str, ModelArgs] = {
    # CPU-sized: Qwen3.5-MoE's debug model (8 experts of 128, top-2, a shared expert of 128).
    "debugmodel": qwen3_next_args(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, experts=8, top_k=2, expert_ffn=128,
                                  dense_ffn=512, linear=DEBUG_LINEAR, head_dim=32, vocab_size=-1),
    "80B-A3B": qwen3_next_args(dim=2048, n_layers=48, n_heads=16, n_kv_heads=2, experts=512, top_k=10,
                               expert_ffn=512, dense_ffn=5120,
                               linear=LinearAttentionArgs(num_key_heads=16, num_value_heads=32, key_head_dim=128,
                                                          value_head_dim=128)),
}

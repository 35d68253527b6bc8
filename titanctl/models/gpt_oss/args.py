"""gpt-oss flavors: the shared decoder with gpt-oss's switches (attention biases and sinks,
sliding-window layers, YaRN, clamped-SwiGLU experts with biases, a biased router that takes its
softmax over the chosen experts only).

Published dimensions: the ``config.json`` of openai/gpt-oss-20b and openai/gpt-oss-120b on Hugging
Face (hidden_size 2880, 64 heads of head_dim 64 over 8 key/value heads, intermediate_size 2880 per
expert, num_experts_per_tok 4, num_local_experts 32 / 128, num_hidden_layers 24 / 36, sliding_window
128 on every even layer, rope_theta 150000 with YaRN factor 32 over 4096 positions, beta_fast 32,
beta_slow 1, truncate false, rms_norm_eps 1e-5, swiglu_limit 7.0 (alpha 1.702), vocab 201088,
untied, max_position_embeddings 131072).
"""

from __future__ import annotations

from titanctl.models.common.args import ModelArgs, MoEArgs, YarnScaling

GPT_OSS_VOCAB_SIZE = 201088
GPT_OSS_YARN = YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                           mscale=0.0, mscale_all_dim=0.0, truncate=False)
# Layer 0 slides, layer 1 attends to all, and so on (transformers' default layer_types, torchtitan's).
ALTERNATING = ("sliding_attention", "full_attention")


def gpt_oss_args(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, experts: int, top_k: int,
                 expert_ffn: int, window: int = 128, vocab_size: int = GPT_OSS_VOCAB_SIZE) -> ModelArgs:
    moe = MoEArgs(num_experts=experts, top_k=top_k, hidden_dim=expert_ffn, score_func="softmax_topk",
                  norm_topk_prob=True, router_bias=True, expert_kind="clamped_swiglu", swiglu_limit=7.0,
                  swiglu_alpha=1.702)
    return ModelArgs(
        family="gpt_oss", dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=vocab_size,
        explicit_head_dim=head_dim, explicit_ffn_hidden_dim=expert_ffn, norm_eps=1e-5, rope_theta=150000.0,
        rope_scaling=None, yarn=GPT_OSS_YARN, rope_layout="halves", moe=moe, attention_bias=True,
        attention_sinks=True, layer_types=ALTERNATING, sliding_window=window,
    )


GPT_OSS_FLAVORS: dict[str, ModelArgs] = {
    # CPU-sized, every gpt-oss mechanism on: 4 layers (sliding, full, sliding, full) with a 32-position
    # window under a 256-token recipe, 8 experts of 128, top-2.
    "debugmodel": gpt_oss_args(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32, experts=8, top_k=2,
                               expert_ffn=128, window=32, vocab_size=-1),
    "20b": gpt_oss_args(dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim=64, experts=32, top_k=4,
                        expert_ffn=2880),
    "120b": gpt_oss_args(dim=2880, n_layers=36, n_heads=64, n_kv_heads=8, head_dim=64, experts=128, top_k=4,
                         expert_ffn=2880),
}

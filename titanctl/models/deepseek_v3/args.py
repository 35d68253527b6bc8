"""DeepSeek-V3 flavors: Multi-head Latent Attention, YaRN RoPE, the first layers dense and the rest a
Mixture of Experts with shared experts and (671B) sigmoid scores routed within the best expert groups.

Published dimensions:
- 671B: DeepSeek-V3's ``config.json`` on Hugging Face (deepseek-ai/DeepSeek-V3): hidden_size 7168,
  61 layers (the first 3 dense, intermediate_size 18432), 128 heads, q_lora_rank 1536, kv_lora_rank
  512, qk_nope/qk_rope/v head dims 128/64/128, 256 routed experts of 2048 (top-8, 1 shared),
  n_group 8, topk_group 4, routed_scaling_factor 2.5, sigmoid scores, norm_topk_prob, vocab 129280,
  rope_theta 10000, YaRN factor 40 over 4096 positions (beta_fast 32, beta_slow 1, mscale and
  mscale_all_dim 1), rms_norm_eps 1e-6. Its multi-token-prediction module is not built here.
- 16B: torchtitan's deepseek_v3 "16B" (DeepSeek-V2-Lite's shape): hidden 2048, 27 layers (the
  first dense, 10944 wide), 16 heads, queries without LoRA, kv_lora_rank 512, 64 routed experts of
  1408 (top-6, 2 shared), softmax scores without renormalization or groups, vocab 102400, YaRN factor
  40 over 4096 positions with mscale 0.70.

YaRN is on at every sequence length, as transformers applies a config's ``rope_parameters`` (torchtitan
turns it on only beyond the original 4096 positions).
"""

from __future__ import annotations

from titanctl.models.common.args import MLAArgs, ModelArgs, MoEArgs, YarnScaling

DEEPSEEK_V3_VOCAB_SIZE = 129280
V3_YARN = YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                      mscale=1.0, mscale_all_dim=1.0)


def deepseek_v3_args(dim: int, n_layers: int, n_heads: int, dense_ffn: int, mla: MLAArgs, moe: MoEArgs,
                     yarn: YarnScaling = V3_YARN, vocab_size: int = DEEPSEEK_V3_VOCAB_SIZE) -> ModelArgs:
    return ModelArgs(
        family="deepseek_v3", dim=dim, n_layers=n_layers, n_heads=n_heads, vocab_size=vocab_size,
        # head_dim: the query/key width, whose 1/sqrt scales the scores (values may be narrower).
        explicit_head_dim=mla.qk_head_dim, explicit_ffn_hidden_dim=dense_ffn, mla=mla, moe=moe,
        rope_theta=10000.0, rope_scaling=None, yarn=yarn, rope_layout="interleaved", norm_eps=1e-6,
    )


DEEPSEEK_V3_FLAVORS: dict[str, ModelArgs] = {
    # CPU-sized, every DeepSeek-V3 mechanism on: q LoRA, a dense first layer, 8 experts in 2 groups
    # (top-2 from the best group), a shared expert, sigmoid scores with the expert bias, YaRN. The
    # latent is the published 512 + 64 = 576 wide: vLLM's CPU MLA takes no other width (on GPU 320 and
    # 512 too: titanctl.checkpoint.hf.serving_kernels).
    "debugmodel": deepseek_v3_args(
        dim=256, n_layers=6, n_heads=8, dense_ffn=768,
        mla=MLAArgs(q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32),
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=128, score_func="sigmoid", norm_topk_prob=True,
                    route_scale=2.5, num_shared_experts=1, first_dense_layers=1, n_group=2, topk_group=1),
        vocab_size=-1,
    ),
    "16B": deepseek_v3_args(
        dim=2048, n_layers=27, n_heads=16, dense_ffn=10944,
        mla=MLAArgs(q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEArgs(num_experts=64, top_k=6, hidden_dim=1408, score_func="softmax", norm_topk_prob=False,
                    route_scale=1.0, num_shared_experts=2, first_dense_layers=1),
        yarn=YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                         mscale=0.70, mscale_all_dim=0.70),
        vocab_size=102400,
    ),
    "671B": deepseek_v3_args(
        dim=7168, n_layers=61, n_heads=128, dense_ffn=18432,
        mla=MLAArgs(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEArgs(num_experts=256, top_k=8, hidden_dim=2048, score_func="sigmoid", norm_topk_prob=True,
                    route_scale=2.5, num_shared_experts=1, first_dense_layers=3, n_group=8, topk_group=4),
    ),
}

"""Llama 3.x's published flavors (ModelArgs and RopeScaling are the shared ``titanctl.models.common.args``)."""

from __future__ import annotations

from titanctl.models.common.args import ModelArgs, RopeScaling

# Llama 3.2's small models stretch RoPE 4x further than 3.1 (factor 32, same bands and context).
LLAMA32_ROPE = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

LLAMA3_FLAVORS: dict[str, ModelArgs] = {
    # CPU-sized: 8 heads of 32 (vLLM's CPU attention takes no head narrower than 32:
    # titanctl.checkpoint.hf.serving_kernels), 2 of them key/value, as 8B's ratio of 4.
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=8, n_kv_heads=2),
    # torchtitan's own debugmodel (0.2 and 0.3): the same widths in 16 heads of 16, all of them
    # key/value; what a torchtitan debug checkpoint, which records no config, is read as.
    "debugmodel_torchtitan": ModelArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=16),
    "8B": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024
    ),
    "70B": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096
    ),
    "405B": ModelArgs(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096
    ),
    # Llama 3.2 (text): tied embeddings. FFN from Meta's params.json (multiplier 1.5 and 1.0,
    # multiple_of 256), which gives the published intermediate_size 8192 for both.
    "1B": ModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
        rope_scaling=LLAMA32_ROPE, tie_embeddings=True,
    ),
    "3B": ModelArgs(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256,
        rope_scaling=LLAMA32_ROPE, tie_embeddings=True,
    ),
}

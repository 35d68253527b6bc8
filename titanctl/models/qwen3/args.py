"""Qwen3 (dense) flavors: the shared ModelArgs with Qwen3's switches.

Qwen3 is Llama's decoder plus a per-head RMSNorm on queries and keys, with an explicit head
width (128 in every published size, whatever dim / n_heads is), an explicit FFN width, RoPE
theta 1e6 without scaling, norm eps 1e-6, and "rotate half" RoPE, the layout of the published
weights: they load by renaming alone. The small sizes tie the output layer to the embedding.

Published dimensions: the ``config.json`` of Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B,32B} on Hugging Face
(hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim 128,
intermediate_size, tie_word_embeddings, rope_theta 1000000, rms_norm_eps 1e-6, vocab 151936).
"""

from __future__ import annotations

from titanctl.models.common.args import ModelArgs

# The published checkpoints' embedding rows, more than the tokenizer's 151669 ids: a recipe of a
# published size keeps them, so its checkpoints load into transformers and back (debugmodel: the tokenizer's).
QWEN3_VOCAB_SIZE = 151936


def qwen3_args(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn: int, tied: bool,
               head_dim: int = 128, vocab_size: int = QWEN3_VOCAB_SIZE) -> ModelArgs:
    return ModelArgs(
        family="qwen3", vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
        explicit_head_dim=head_dim, explicit_ffn_hidden_dim=ffn, tie_embeddings=tied,
        qk_norm=True, rope_layout="halves", rope_theta=1_000_000.0, rope_scaling=None, norm_eps=1e-6,
    )


QWEN3_FLAVORS: dict[str, ModelArgs] = {
    # CPU-sized, tied like the small Qwen3s, with queries twice as wide as dim (as 0.6B's 16 x 128
    # over 1024), so CPU tests exercise the tie and the explicit head width. ~6.6M parameters
    # with the bundled 4352-token tokenizer.
    "debugmodel": qwen3_args(dim=256, n_layers=6, n_heads=16, n_kv_heads=4, ffn=768, tied=True, head_dim=32,
                             vocab_size=-1),
    # The same with its own output layer: pipeline stages cannot share the embedding (see docs/models.md).
    "debugmodel_untied": qwen3_args(dim=256, n_layers=6, n_heads=16, n_kv_heads=4, ffn=768, tied=False,
                                    head_dim=32, vocab_size=-1),
    "0.6B": qwen3_args(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn=3072, tied=True),
    "1.7B": qwen3_args(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn=6144, tied=True),
    "4B": qwen3_args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn=9728, tied=True),
    "8B": qwen3_args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn=12288, tied=False),
    "14B": qwen3_args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn=17408, tied=False),
    "32B": qwen3_args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn=25600, tied=False),
}

"""Qwen3.5 (dense) flavors: the shared ModelArgs with Qwen3.5's switches.

Beside Qwen3's attention (QK norm, an explicit head width, "rotate half" RoPE) Qwen3.5 has: a layer
schedule (``layer_types``: "linear_attention" Gated DeltaNet layers, every fourth "full_attention"),
RoPE on a quarter of each head (``partial_rope_dim``), a sigmoid output gate on full attention
(``attention_output_gate``), and zero-centred RMSNorms scaling by 1 + weight (``norm_offset``), as
Qwen3-Next has them, except the Gated DeltaNet's own gated norm, which scales by its weight.
"""

from __future__ import annotations

from titanctl.models.common.args import LinearAttentionArgs, ModelArgs

# The published checkpoints' embedding rows (Qwen3.5's tokenizer, with its vision tokens).
QWEN3_5_VOCAB_SIZE = 248320
FULL_ATTENTION_INTERVAL = 4  # the published schedule: layers 3, 7, 11, ... are full attention


def layer_schedule(n_layers: int, interval: int = FULL_ATTENTION_INTERVAL) -> tuple[str, ...]:
    """Every ``interval``-th layer full attention, the others Gated DeltaNet (transformers' default)."""
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers))


def qwen3_5_args(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn: int, tied: bool,
                 linear: LinearAttentionArgs, head_dim: int = 256, vocab_size: int = QWEN3_5_VOCAB_SIZE,
                 rope_fraction: float = 0.25) -> ModelArgs:
    return ModelArgs(
        family="qwen3_5", vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
        explicit_head_dim=head_dim, explicit_ffn_hidden_dim=ffn, tie_embeddings=tied,
        qk_norm=True, rope_layout="halves", rope_theta=10_000_000.0, rope_scaling=None, norm_eps=1e-6,
        layer_types=layer_schedule(n_layers), linear_attention=linear, partial_rope_dim=int(head_dim * rope_fraction),
        attention_output_gate=True, norm_offset=True,
    )


# CPU-sized: 2 key heads of 32 serving 4 value heads of 32, a full-attention layer after every three
# Gated DeltaNet layers, RoPE on 8 of each head's 32 channels.
DEBUG_LINEAR = LinearAttentionArgs(num_key_heads=2, num_value_heads=4, key_head_dim=32, value_head_dim=32)

QWEN3_5_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": qwen3_5_args(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn=512, tied=True,
                               linear=DEBUG_LINEAR, head_dim=32, vocab_size=-1),
    # Its own output layer: pipeline layouts need one (the embedding and the output live on different stages).
    "debugmodel_untied": qwen3_5_args(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn=512, tied=False,
                                      linear=DEBUG_LINEAR, head_dim=32, vocab_size=-1),
}

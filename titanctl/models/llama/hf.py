"""Llama 3.x as Hugging Face's ``LlamaForCausalLM`` (names and config.json), and torchtune's names.

Meta's RoPE rotates interleaved channel pairs, Hugging Face's rotates halves; titanctl's Llama
keeps Meta's layout (``rope_layout="interleaved"``), so the checkpoint layer permutes the rows of
``wq`` and ``wk`` within each head on the way (that is a property of the args, not of this map).
"""

from __future__ import annotations

from typing import Any

from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.hf_config import (
    DECODER_LAYER_NAMES,
    DECODER_TOP_NAMES,
    ConfigJson,
    check_plain_decoder,
    decoder_args,
    decoder_config,
    rope_from_hf,
)
from titanctl.models.spec import HFFormat


def config_from_args(args: ModelArgs, max_position_embeddings: int | None) -> dict[str, Any]:
    """``max_position_embeddings`` defaults to ``max_seq_len``, and with Llama 3.1 scaling to at
    least 16 x the original context (Meta's published 131072 = 16 x 8192); it must exceed
    ``original_max_position_embeddings``."""
    scaling = args.rope_scaling
    if max_position_embeddings is None:
        max_position_embeddings = args.max_seq_len
        if scaling is not None:
            max_position_embeddings = max(max_position_embeddings, 16 * scaling.original_max_position_embeddings)
    if scaling is not None and max_position_embeddings <= scaling.original_max_position_embeddings:
        raise CheckpointError(
            f"max_position_embeddings {max_position_embeddings} must exceed the RoPE scaling's "
            f"original_max_position_embeddings {scaling.original_max_position_embeddings}"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **decoder_config(args, max_position_embeddings),
        "mlp_bias": False,
        "pretraining_tp": 1,
    }


def _ffn_args(dim: int, hidden: int) -> tuple[int, float | None]:
    """(multiple_of, ffn_dim_multiplier) for which ModelArgs.ffn_hidden_dim == hidden: Meta's
    params.json describes the width so, and titanctl.json files keep it comparable."""
    if hidden <= 0:
        raise CheckpointError(f"intermediate_size must be positive, got {hidden}")
    base = int(2 * 4 * dim / 3)
    candidates: list[tuple[int, float | None]] = [
        (256, None),  # Llama defaults
        (1024, 1.3),  # 8B
        (4096, 1.3),  # 70B
        (4096, 1.2),  # 405B
        (256, 1.5),  # 3.2 1B
        (256, 1.0),  # 3.2 3B
        # Fallback, always exact: round up to `hidden` itself, after shrinking if needed.
        (hidden, None if base <= hidden else hidden / base),
    ]
    for multiple_of, multiplier in candidates:
        probe = ModelArgs(dim=dim, multiple_of=multiple_of, ffn_dim_multiplier=multiplier)
        if probe.ffn_hidden_dim == hidden:
            return multiple_of, multiplier
    raise CheckpointError(f"cannot express intermediate_size {hidden} for dim {dim} in ModelArgs")


def args_from_config(config: dict[str, Any], max_seq_len: int | None, where: str) -> ModelArgs:
    cfg = ConfigJson(config, where)
    declared = decoder_args(cfg, "llama3", max_seq_len)
    if declared.dim % declared.n_heads:
        raise CheckpointError(f"{where}: dim {declared.dim} is not divisible by n_heads {declared.n_heads}")
    if cfg.integer("head_dim", None) not in (None, declared.head_dim):
        raise CheckpointError(
            f"{where}: head_dim {cfg.get('head_dim')} != hidden_size / num_attention_heads = {declared.head_dim}"
        )
    check_plain_decoder(cfg, "Llama 3")
    theta, scaling = rope_from_hf(cfg, "Llama 3")
    multiple_of, multiplier = _ffn_args(declared.dim, cfg.integer("intermediate_size", minimum=1))
    return declared.replace(multiple_of=multiple_of, ffn_dim_multiplier=multiplier, rope_theta=theta,
                            rope_scaling=scaling)


def special_ids(vocab_size: int) -> tuple[int | None, int | None]:
    """Llama 3's 256 special tokens come last: Meta's tokenizer (128256 -> 128000, 128001) and
    titanctl's bundled one (4352 -> 4096, 4097)."""
    return (None, None) if vocab_size <= 256 else (vocab_size - 256, vocab_size - 255)


HF = HFFormat(
    model_type="llama",
    architecture="LlamaForCausalLM",
    layer_names=DECODER_LAYER_NAMES,
    top_names=DECODER_TOP_NAMES,
    config_from_args=config_from_args,
    args_from_config=args_from_config,
    special_ids=special_ids,
)

# torchtune's Llama 3 builders (llama3_1_8b ...): per-layer suffixes and top-level names.
TORCHTUNE_NAMES = (
    {
        "attention.wq.weight": "attn.q_proj.weight",
        "attention.wk.weight": "attn.k_proj.weight",
        "attention.wv.weight": "attn.v_proj.weight",
        "attention.wo.weight": "attn.output_proj.weight",
        "attention_norm.weight": "sa_norm.scale",
        "ffn_norm.weight": "mlp_norm.scale",
        "feed_forward.w1.weight": "mlp.w1.weight",
        "feed_forward.w2.weight": "mlp.w2.weight",
        "feed_forward.w3.weight": "mlp.w3.weight",
    },
    {"tok_embeddings.weight": "tok_embeddings.weight", "norm.weight": "norm.scale", "output.weight": "output.weight"},
)

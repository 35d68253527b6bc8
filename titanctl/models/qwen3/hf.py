"""Qwen3 (dense) as Hugging Face's ``Qwen3ForCausalLM``: names and config.json.

The published weights use "rotate half" RoPE, which titanctl's Qwen3 keeps
(``rope_layout="halves"``): they load by renaming alone. A tied checkpoint may lack
``lm_head.weight`` (transformers does not save it): the embedding stands in for it.
"""

from __future__ import annotations

from typing import Any

from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.hf_config import (
    DECODER_LAYER_NAMES,
    DECODER_TOP_NAMES,
    QK_NORM_NAMES,
    ConfigJson,
    check_plain_decoder,
    decoder_args,
    decoder_config,
    rope_from_hf,
)
from titanctl.models.spec import HFFormat


def config_from_args(args: ModelArgs, max_position_embeddings: int | None) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **decoder_config(args, max_position_embeddings or max(args.max_seq_len, 40960)),
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
    }


def args_from_config(config: dict[str, Any], max_seq_len: int | None, where: str) -> ModelArgs:
    cfg = ConfigJson(config, where)
    declared = decoder_args(cfg, "qwen3", max_seq_len)
    check_plain_decoder(cfg, "Qwen3")
    if cfg.flag("use_sliding_window", False):
        raise CheckpointError(f"{where}: use_sliding_window=true (sliding-window attention) is not supported")
    # transformers' Qwen3Config lists each layer's attention; without a sliding window, every one is full
    cfg.strings("layer_types", length=declared.n_layers, choices=("full_attention",))
    theta, scaling = rope_from_hf(cfg, "Qwen3")
    if scaling is not None:
        raise CheckpointError(f"{where}: Qwen3 with Llama 3.1 RoPE scaling is not a published Qwen3")
    head_dim = cfg.integer("head_dim", 0, minimum=0) or declared.dim // declared.n_heads
    return declared.replace(
        explicit_head_dim=head_dim, explicit_ffn_hidden_dim=cfg.integer("intermediate_size", minimum=1),
        qk_norm=True, rope_layout="halves", rope_theta=theta, rope_scaling=None,
    )


HF = HFFormat(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    layer_names={**DECODER_LAYER_NAMES, **QK_NORM_NAMES},
    top_names=DECODER_TOP_NAMES,
    config_from_args=config_from_args,
    args_from_config=args_from_config,
)

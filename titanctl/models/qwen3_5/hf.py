"""Qwen3.5 (dense) as Hugging Face's ``Qwen3_5ForCausalLM`` (model_type ``qwen3_5_text``): names and config.json.

Full-attention layers keep Qwen3's names (``self_attn.*``; ``q_proj`` holds each head's query rows, then
its gate rows); Gated DeltaNet layers are ``linear_attn.*``. Norm weights are stored as they are used,
zero-centred (the model scales by 1 + weight): they load by renaming alone. The Gated DeltaNet's
``in_proj_qkv`` rows and ``conv1d`` channels, [all q | all k | all v] on the Hub, are titanctl's per
key-head group [q_h | k_h | v of h] (gated_deltanet.py says why): reordered on read and back on write.
"""

from __future__ import annotations

from typing import Any

import torch

from titanctl.errors import CheckpointError
from titanctl.models.common.args import LinearAttentionArgs, ModelArgs
from titanctl.models.common.hf_config import (
    DECODER_LAYER_NAMES,
    DECODER_TOP_NAMES,
    QK_NORM_NAMES,
    ConfigJson,
    check_plain_decoder,
    decoder_args,
    decoder_config,
)
from titanctl.models.spec import HFFormat

GATED_DELTANET_NAMES = {
    "attention.wqkv.weight": "linear_attn.in_proj_qkv.weight",
    "attention.wz.weight": "linear_attn.in_proj_z.weight",
    "attention.wb.weight": "linear_attn.in_proj_b.weight",
    "attention.wa.weight": "linear_attn.in_proj_a.weight",
    "attention.conv.weight": "linear_attn.conv1d.weight",
    "attention.dt_bias": "linear_attn.dt_bias",
    "attention.a_log": "linear_attn.A_log",
    "attention.norm.weight": "linear_attn.norm.weight",
    "attention.out_proj.weight": "linear_attn.out_proj.weight",
}


def _group_widths(args: ModelArgs) -> tuple[int, int, int]:
    la = args.linear_attention
    return la.num_key_heads, la.key_head_dim, la.num_value_heads // la.num_key_heads * la.value_head_dim


def grouped_from_hf(rows: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """[all q | all k | all v] rows (dim 0) -> per key head h [q_h | k_h | v of h]."""
    heads, dk, dv = _group_widths(args)
    q, k, v = rows.split([heads * dk, heads * dk, heads * dv])
    rest = rows.shape[1:]
    grouped = torch.cat([q.reshape(heads, dk, *rest), k.reshape(heads, dk, *rest), v.reshape(heads, dv, *rest)], 1)
    return grouped.reshape(rows.shape)


def grouped_to_hf(rows: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """``grouped_from_hf`` inverted."""
    heads, dk, dv = _group_widths(args)
    rest = rows.shape[1:]
    q, k, v = rows.reshape(heads, 2 * dk + dv, *rest).split([dk, dk, dv], dim=1)
    return torch.cat([q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)])


GROUPED_ROWS = {name: (grouped_to_hf, grouped_from_hf) for name in ("attention.wqkv.weight", "attention.conv.weight")}
LAYER_NAMES = {**DECODER_LAYER_NAMES, **QK_NORM_NAMES, **GATED_DELTANET_NAMES}
CHOICES = ("linear_attention", "full_attention")


def hybrid_config(args: ModelArgs, max_position_embeddings: int | None) -> dict[str, Any]:
    """config.json keys of the hybrid decoders (dense and MoE): the shared ones, the schedule, the
    Gated DeltaNet's widths and the partial RoPE."""
    la = args.linear_attention
    config = decoder_config(args, max_position_embeddings or max(args.max_seq_len, 262144))
    fraction = args.rope_dim / args.head_dim
    config["rope_parameters"] = {**config["rope_parameters"], "partial_rotary_factor": fraction}
    return {
        **config,
        "partial_rotary_factor": fraction,  # transformers 4.x reads it at the top level
        "layer_types": list(args.layer_types),
        "linear_conv_kernel_dim": la.conv_kernel,
        "linear_key_head_dim": la.key_head_dim,
        "linear_value_head_dim": la.value_head_dim,
        "linear_num_key_heads": la.num_key_heads,
        "linear_num_value_heads": la.num_value_heads,
    }


def config_from_args(args: ModelArgs, max_position_embeddings: int | None) -> dict[str, Any]:
    return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
            **hybrid_config(args, max_position_embeddings)}


def hybrid_args(cfg: ConfigJson, family: str, max_seq_len: int | None, what: str) -> ModelArgs:
    """ModelArgs of a hybrid decoder's config.json (the keys ``hybrid_config`` writes), each refusal one line."""
    declared = decoder_args(cfg, family, max_seq_len)
    check_plain_decoder(cfg, what)
    where = cfg.where
    if declared.n_heads % declared.kv_heads:
        raise CheckpointError(f"{where}: num_key_value_heads {declared.kv_heads} must divide num_attention_heads "
                              f"{declared.n_heads}")
    layer_types = cfg.strings("layer_types", length=declared.n_layers, choices=CHOICES)
    if layer_types is None:
        interval = cfg.integer("full_attention_interval", 4, minimum=1)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                       for i in range(declared.n_layers)]
    la = LinearAttentionArgs(
        num_key_heads=cfg.integer("linear_num_key_heads", 16, minimum=1),
        num_value_heads=cfg.integer("linear_num_value_heads", 32, minimum=1),
        key_head_dim=cfg.integer("linear_key_head_dim", 128, minimum=1),
        value_head_dim=cfg.integer("linear_value_head_dim", 128, minimum=1),
        conv_kernel=cfg.integer("linear_conv_kernel_dim", 4, minimum=1),
    )
    if la.num_value_heads % la.num_key_heads:
        raise CheckpointError(f"{where}: linear_num_key_heads {la.num_key_heads} must divide linear_num_value_heads "
                              f"{la.num_value_heads}")
    params = cfg.section("rope_parameters", "rope_scaling")
    if params.text("rope_type", params.text("type", "default")) != "default":
        raise CheckpointError(f"{where}: {what} with scaled RoPE ({params.get('rope_type')!r}) is not supported")
    theta = params.number("rope_theta", None, above=0) or cfg.number("rope_theta", 10_000_000.0, above=0)
    fraction = params.number("partial_rotary_factor", None, above=0) or cfg.number("partial_rotary_factor", 0.25,
                                                                                    above=0)
    head_dim = cfg.integer("head_dim", 0, minimum=0) or declared.dim // declared.n_heads
    rope_dim = int(head_dim * fraction)
    if fraction > 1 or rope_dim % 2:
        raise CheckpointError(f"{where}: partial_rotary_factor {fraction:g} of head_dim {head_dim} must rotate an even "
                              "number of channels, at most all of them")
    return declared.replace(
        explicit_head_dim=head_dim, explicit_ffn_hidden_dim=cfg.integer("intermediate_size", minimum=1),
        qk_norm=True, rope_layout="halves", rope_theta=theta, rope_scaling=None, layer_types=tuple(layer_types),
        linear_attention=la, partial_rope_dim=rope_dim, attention_output_gate=True, norm_offset=True,
    )


def args_from_config(config: dict[str, Any], max_seq_len: int | None, where: str) -> ModelArgs:
    return hybrid_args(ConfigJson(config, where), "qwen3_5", max_seq_len, "Qwen3.5")


HF = HFFormat(
    model_type="qwen3_5_text",
    architecture="Qwen3_5ForCausalLM",
    layer_names=LAYER_NAMES,
    top_names=DECODER_TOP_NAMES,
    config_from_args=config_from_args,
    args_from_config=args_from_config,
    reordered_rows=GROUPED_ROWS,
)

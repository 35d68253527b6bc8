"""Hugging Face names and ``config.json`` keys that the dense decoder families share.

Llama and Qwen3 are the same ``*ForCausalLM`` layout in transformers; their families add their
own keys (``titanctl.models.llama.hf``, ``titanctl.models.qwen3.hf``). Pure functions, no
``transformers`` import.
"""

from __future__ import annotations

from typing import Any

from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs, RopeScaling, YarnScaling

# Per-layer suffixes: titanctl name -> Hugging Face name (under model.layers.{i}.).
DECODER_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
QK_NORM_NAMES = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
DECODER_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

DEFAULT_THETA = 10000.0  # what transformers assumes when a config names no theta
DEFAULT_EPS = 1e-6  # LlamaConfig's and Qwen3Config's default rms_norm_eps


def whole(value: Any) -> int:
    """An integer field: ints (and integral floats, as some exporters write them) only."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError(f"{value!r} is not an integer")
    return int(value)


def require(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise CheckpointError(f"Hugging Face config lacks {key!r}")
    return cfg[key]


def decoder_args(cfg: dict[str, Any], family: str, max_seq_len: int | None, where: str) -> ModelArgs:
    """The fields every dense decoder's config.json has, as ModelArgs of ``family``; the counts a
    reader divides by are checked to be positive first."""
    n_heads = whole(require(cfg, "num_attention_heads"))
    args = ModelArgs(
        family=family,
        dim=whole(require(cfg, "hidden_size")),
        n_layers=whole(require(cfg, "num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=whole(cfg.get("num_key_value_heads") or n_heads),
        vocab_size=whole(require(cfg, "vocab_size")),
        norm_eps=float(cfg.get("rms_norm_eps", DEFAULT_EPS)),
        max_seq_len=whole(max_seq_len or cfg.get("max_position_embeddings") or ModelArgs.max_seq_len),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    for name in ("dim", "n_layers", "n_heads", "kv_heads"):
        if getattr(args, name) < 1:
            raise CheckpointError(f"{where}: {name.replace('kv_heads', 'n_kv_heads')} is {getattr(args, name)}, "
                                  "expected an integer >= 1")
    return args


def check_plain_decoder(cfg: dict[str, Any], what: str) -> None:
    """Refuse what the shared decoder does not build: other activations, biases."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {cfg['hidden_act']!r} is not {what}'s 'silu'")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise CheckpointError(f"{flag}=true: {what} has no biases")


def rope_from_hf(cfg: dict[str, Any], what: str) -> tuple[float, RopeScaling | None]:
    """RoPE theta and Llama 3.1-style scaling from 4.x keys (rope_theta, rope_scaling) or 5.x's
    rope_parameters."""
    # transformers 5 prefers a 4.x `rope_scaling` over `rope_parameters` when both are present.
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    v5_theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    thetas = (params.get("rope_theta"), cfg.get("rope_theta"), v5_theta)
    theta = next((t for t in thetas if t is not None), DEFAULT_THETA)
    if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError(f"partial rotary embeddings (partial_rotary_factor != 1) are not {what}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise CheckpointError(f"unsupported RoPE type {rope_type!r} (titanctl knows 'default' and 'llama3')")
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            # transformers falls back to max_position_embeddings, so do we.
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings") or require(cfg, "max_position_embeddings")
            ),
        )
    except KeyError as e:
        raise CheckpointError(f"Hugging Face llama3 RoPE scaling lacks {e.args[0]!r}") from None
    return float(theta), scaling


def decoder_config(args: ModelArgs, max_position_embeddings: int) -> dict[str, Any]:
    """config.json keys every dense decoder writes. RoPE is written twice: 4.x's ``rope_theta`` +
    ``rope_scaling`` (which 5.x still reads, and prefers) and 5.x's ``rope_parameters``."""
    scaling = args.rope_scaling
    theta = float(args.rope_theta)
    if scaling is None:
        rope_scaling = None
        rope_parameters = {"rope_type": "default", "rope_theta": theta}
    else:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": float(scaling.factor),
            "low_freq_factor": float(scaling.low_freq_factor),
            "high_freq_factor": float(scaling.high_freq_factor),
            "original_max_position_embeddings": int(scaling.original_max_position_embeddings),
        }
        rope_parameters = {**rope_scaling, "rope_theta": theta}
    return {
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def yarn_from_config(cfg: dict[str, Any], where: str, family: str, default_theta: float, *,
                     takes_mscale: bool, takes_truncate: bool) -> tuple[float, YarnScaling | None]:
    """RoPE theta and YaRN (or none) from 4.x keys (rope_theta, rope_scaling) or 5.x's rope_parameters,
    for a family whose YaRN takes DeepSeek's mscale terms (``takes_mscale``) or transformers' ``truncate``
    (``takes_truncate``: whole pairs at the ramp's ends or not); what the family's YaRN lacks is refused."""
    # transformers 5 prefers a 4.x `rope_scaling` over `rope_parameters` when both are present.
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    thetas = (params.get("rope_theta"), cfg.get("rope_theta"), (cfg.get("rope_parameters") or {}).get("rope_theta"))
    theta = float(next((t for t in thetas if t is not None), default_theta))
    if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError(f"{where}: partial rotary embeddings (partial_rotary_factor != 1) are not {family}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise CheckpointError(f"{where}: unsupported RoPE type {rope_type!r} for {family} ('default' or 'yarn')")
    if params.get("attention_factor") is not None:
        raise CheckpointError(f"{where}: YaRN with attention_factor is not {family}'s")
    if not takes_mscale and (params.get("mscale") or params.get("mscale_all_dim")):
        raise CheckpointError(f"{where}: YaRN with mscale or mscale_all_dim is not {family}'s")
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise CheckpointError(f"{where}: YaRN truncate is {truncate!r}, expected true or false")
    if not takes_truncate and not truncate:
        raise CheckpointError(f"{where}: YaRN with truncate=false is not {family}'s")
    if params.get("factor") is None:
        raise CheckpointError(f"{where}: YaRN RoPE scaling lacks 'factor'")
    return theta, YarnScaling(
        factor=float(params["factor"]),
        # transformers falls back to max_position_embeddings, so do we.
        original_max_position_embeddings=whole(
            params.get("original_max_position_embeddings") or require(cfg, "max_position_embeddings")
        ),
        beta_fast=float(params.get("beta_fast") or 32.0),  # transformers' defaults, also for 0
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),  # 0: not given
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        truncate=truncate,
    )

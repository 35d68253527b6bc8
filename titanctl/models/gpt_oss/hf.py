"""gpt-oss as Hugging Face's ``GptOssForCausalLM``: names and config.json.

transformers holds (and ``save_pretrained`` writes) each layer's experts as four stacked tensors:
``mlp.experts.gate_up_proj`` (E, dim, 2 x hidden), the gate's and the up projection's columns
interleaved, with ``gate_up_proj_bias`` (E, 2 x hidden), and ``down_proj`` (E, hidden, dim) with
``down_proj_bias`` (E, dim). titanctl's ``w13`` and ``w2`` are the same tensors with the last two
dimensions swapped (``HFFormat.transposed``), the rows of w13 in the same interleaved order, so
the weights convert by renaming and transposing alone. The published checkpoints store those two
matrices in MXFP4 (``gate_up_proj_blocks`` / ``_scales``, ...): ``titanctl.checkpoint.quantized.mxfp4`` reads
them. RoPE rotates halves, as titanctl's gpt-oss does; YaRN as transformers computes it (truncate
false keeps the ramp's fractional ends).
"""

from __future__ import annotations

from typing import Any

from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs, MoEArgs
from titanctl.models.common.hf_config import (
    DECODER_LAYER_NAMES,
    DECODER_TOP_NAMES,
    ConfigJson,
    decoder_args,
    yarn_from_config,
)
from titanctl.models.spec import HFFormat

ATTENTION_NAMES = {
    **{f"attention.w{p}.{kind}": f"self_attn.{p}_proj.{kind}" for p in "qkvo" for kind in ("weight", "bias")},
    "attention.sinks": "self_attn.sinks",
}
MOE_NAMES = {
    "moe.router.gate.weight": "mlp.router.weight",
    "moe.router.gate.bias": "mlp.router.bias",
    "moe.experts.w13": "mlp.experts.gate_up_proj",  # transposed
    "moe.experts.b13": "mlp.experts.gate_up_proj_bias",
    "moe.experts.w2": "mlp.experts.down_proj",  # transposed
    "moe.experts.b2": "mlp.experts.down_proj_bias",
}
NORM_NAMES = {k: DECODER_LAYER_NAMES[k] for k in ("attention_norm.weight", "ffn_norm.weight")}
DEFAULT_THETA = 150000.0  # GptOssConfig's default_theta
DEFAULT_MAX_POSITIONS = 131072  # the published context

# gpt-oss's layer kinds (ModelArgs' LAYER_TYPES also has the hybrid families' linear_attention).
GPT_OSS_LAYER_TYPES = ("full_attention", "sliding_attention")


def _rope_config(args: ModelArgs) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(4.x rope_scaling, 5.x rope_parameters), as the published config.json and GptOssConfig write them."""
    theta = float(args.rope_theta)
    yarn = args.yarn
    if yarn is None:
        return None, {"rope_type": "default", "rope_theta": theta}
    scaling = {
        "rope_type": "yarn",
        "factor": float(yarn.factor),
        "beta_fast": float(yarn.beta_fast),
        "beta_slow": float(yarn.beta_slow),
        "truncate": yarn.truncate,
        "original_max_position_embeddings": int(yarn.original_max_position_embeddings),
    }
    return scaling, {**scaling, "rope_theta": theta}


def config_from_args(args: ModelArgs, max_position_embeddings: int | None) -> dict[str, Any]:
    moe = args.moe
    rope_scaling, rope_parameters = _rope_config(args)
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": moe.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "experts_per_token": moe.top_k,  # openai's own name, beside transformers'
        "sliding_window": args.sliding_window or None,
        "layer_types": ["sliding_attention" if args.is_sliding_layer(i) else "full_attention"
                        for i in range(args.n_layers)],
        "swiglu_limit": float(moe.swiglu_limit),
        "swiglu_alpha": float(moe.swiglu_alpha),
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings or max(args.max_seq_len, DEFAULT_MAX_POSITIONS),
        "initial_context_length": int(args.yarn.original_max_position_embeddings) if args.yarn else None,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": float(args.rope_theta),
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "attention_bias": args.attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": args.tie_embeddings,
        "router_aux_loss_coef": 0.9,  # the published value (transformers reads it only with output_router_logits)
        "output_router_logits": False,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def _layer_types(cfg: ConfigJson, n_layers: int) -> tuple[tuple[str, ...], int]:
    """(layer_types, sliding_window): GptOssConfig's default alternation (layer 0 slides) when the
    config names none; no sliding layer at all when its sliding_window is null."""
    if "sliding_window" in cfg.cfg and cfg.cfg["sliding_window"] is None:
        return (), 0
    window = cfg.integer("sliding_window", 128)
    if window < 1:
        raise CheckpointError(f"{cfg.where}: sliding_window {window} must be >= 1 (or null: no sliding layers)")
    types = cfg.strings("layer_types", length=n_layers, choices=GPT_OSS_LAYER_TYPES)
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    # Kept as its shortest repeating pattern (ModelArgs.layer_types repeats over the layers), so that the
    # published configs read as the flavors that declare ("sliding_attention", "full_attention").
    period = next(k for k in range(1, n_layers + 1) if all(types[i] == types[i % k] for i in range(n_layers)))
    return tuple(types[:period]), window


def args_from_config(config: dict[str, Any], max_seq_len: int | None, where: str) -> ModelArgs:
    cfg = ConfigJson(config, where)
    declared = decoder_args(cfg, "gpt_oss", max_seq_len, eps=1e-5)
    if cfg.text("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {cfg.get('hidden_act')!r}: gpt-oss's experts run a clamped SwiGLU")
    theta, yarn = yarn_from_config(cfg, "gpt-oss", DEFAULT_THETA, takes_mscale=False, takes_truncate=True)
    types, window = _layer_types(cfg, declared.n_layers)
    experts = "num_local_experts" if cfg.has("num_local_experts") else "num_experts"
    top_k = "num_experts_per_tok" if cfg.has("num_experts_per_tok") else "experts_per_token"
    moe = MoEArgs(
        num_experts=cfg.integer(experts, minimum=1), top_k=cfg.integer(top_k, minimum=1),
        hidden_dim=cfg.integer("intermediate_size", minimum=1),
        score_func="softmax_topk", norm_topk_prob=True, router_bias=True, expert_kind="clamped_swiglu",
        swiglu_limit=cfg.number("swiglu_limit", 7.0, above=0), swiglu_alpha=cfg.number("swiglu_alpha", 1.702, above=0),
    )
    if not 1 <= moe.top_k <= moe.num_experts:
        raise CheckpointError(f"{where}: num_experts_per_tok {moe.top_k} must be 1 to num_local_experts "
                              f"{moe.num_experts}")
    head_dim = cfg.integer("head_dim", 0, minimum=0) or declared.dim // declared.n_heads
    return declared.replace(
        explicit_head_dim=head_dim, explicit_ffn_hidden_dim=moe.hidden_dim, moe=moe, rope_theta=theta,
        rope_scaling=None, yarn=yarn, rope_layout="halves",
        attention_bias=cfg.flag("attention_bias", True), attention_sinks=True, layer_types=types,
        sliding_window=window,
    )


HF = HFFormat(
    model_type="gpt_oss",
    architecture="GptOssForCausalLM",
    layer_names={**ATTENTION_NAMES, **NORM_NAMES, **MOE_NAMES},
    top_names=DECODER_TOP_NAMES,
    config_from_args=config_from_args,
    args_from_config=args_from_config,
    not_stored=("moe.expert_bias",),
    transposed=("moe.experts.w13", "moe.experts.w2"),
)

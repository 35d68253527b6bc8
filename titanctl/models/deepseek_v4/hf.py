"""DeepSeek-V4 as Hugging Face's ``DeepseekV4ForCausalLM``: the names ``save_pretrained`` writes and
``from_pretrained`` loads, and config.json both ways.

transformers 5.23 holds the model under its own names (``self_attn.q_a_proj``, packed
``mlp.experts.gate_up_proj``) but writes and reads DeepSeek's (its conversion mapping reversed on save):
``model.layers.{i}.attn.wq_a.weight``, ``ffn.experts.{e}.w1/w2/w3.weight`` one tensor per expert,
``hc_attn_fn``, ``attn.attn_sink``, with ``model.embed_tokens``, ``model.norm``, ``model.hc_head.hc_*`` and
``head.weight`` at the top. Those are the names here. titanctl packs each expert's gate and up rows as
transformers does (``gate_up_proj`` = w1 rows then w3 rows: ``HFFormat.per_expert`` with two templates).
The routing state is stored: the hash-routed layers' token -> experts table ``ffn.gate.tid2eid`` (int64; a
checkpoint's table replaces titanctl's seeded one) and the other layers' ``ffn.gate.bias``
(transformers' ``e_score_correction_bias``). Multi-token prediction (``num_nextn_predict_layers``, read and
written; transformers writes 1 without weights, which reads as none): depth k's block is
``model.layers.{n_layers + k}.*`` under the block's names and its own ``e_proj``/``h_proj``/``enorm``/``hnorm``/
``norm``/``hc_head_*`` beside them (``MTP_NAMES``, DeepSeek's names; transformers builds no depth and skips
them); the published folder's ``mtp.{k}.*`` are the same tensors (``hub_layout``). The Hub's published
folder drops the ``model.`` prefix (``layers.{i}.*``, ``embed.weight``, ``hc_head_fn``: ``PUBLISHED_TOP_NAMES``,
read through ``titanctl.checkpoint.hf.hub_layout``); its FP8 block weights (``X.scale`` beside ``X.weight``) and
FP4 experts are dequantized when read (``titanctl.checkpoint.quantized.fp4_experts`` names the sources).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from titanctl.errors import CheckpointError
from titanctl.models.common.args import CompressedAttentionArgs, ModelArgs
from titanctl.models.common.hf_config import ConfigJson
from titanctl.models.deepseek_v4.args import (
    ATTENTION_TYPES,
    CSA,
    HCA,
    MLP_TYPES,
    SLIDING,
    deepseek_v4_args,
    v4_args,
    v4_moe,
)
from titanctl.models.spec import HFFormat


def _compressor(ours: str, theirs: str) -> dict[str, str]:
    return {f"{ours}.kv_proj.weight": f"{theirs}.wkv.weight", f"{ours}.gate_proj.weight": f"{theirs}.wgate.weight",
            f"{ours}.position_bias": f"{theirs}.ape", f"{ours}.kv_norm.weight": f"{theirs}.norm.weight"}


ATTENTION_NAMES = {
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.sinks": "attn.attn_sink",
    **_compressor("self_attn.compressor", "attn.compressor"),
    **_compressor("self_attn.indexer.compressor", "attn.indexer.compressor"),
    "self_attn.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.indexer.weights_proj.weight": "attn.indexer.weights_proj.weight",
}
MOE_NAMES = {
    "mlp.router.weight": "ffn.gate.weight",
    "mlp.expert_bias": "ffn.gate.bias",
    "mlp.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
}
BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"{ours}_hc.{leaf}": f"hc_{ours}_{leaf}" for ours in ("attn", "ffn") for leaf in ("fn", "base", "scale")},
}
PER_EXPERT = {
    "mlp.experts.gate_up_proj": ("ffn.experts.{e}.w1.weight", "ffn.experts.{e}.w3.weight"),
    "mlp.experts.down_proj": "ffn.experts.{e}.w2.weight",
}
TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "head.weight",
    "hc_head.fn": "model.hc_head.hc_fn",
    "hc_head.base": "model.hc_head.hc_base",
    "hc_head.scale": "model.hc_head.hc_scale",
}
# The published folder (deepseek-ai/DeepSeek-V4-Flash's index, as transformers' conversion mapping reads it):
# every layer's name without save_pretrained's model. prefix, and these top-level ones (head.weight is the same).
# A prediction depth's own tensors (mtp.py), by DeepSeek's names in its MTPBlock, after model.layers.{n_layers + k}.
MTP_NAMES = {
    "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight", "norm.weight": "norm.weight",
    **{f"hc_head.{leaf}": f"hc_head_{leaf}" for leaf in ("fn", "base", "scale")},
}
PUBLISHED_TOP_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
# DeepSeek's own config.json (and transformers' legacy keys): a compress ratio per layer.
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")


def _rope_parameters(args: ModelArgs) -> dict[str, Any]:
    ca = args.compressed_attention
    factor = args.rope_dim / args.head_dim
    main = {"rope_type": "default", "rope_theta": float(args.rope_theta), "partial_rotary_factor": factor}
    compress = {"rope_type": "default", "rope_theta": float(ca.compress_rope_theta), "partial_rotary_factor": factor}
    if ca.compress_yarn is not None:
        yarn = dict(zip(_YARN_KEYS, ca.compress_yarn, strict=True))
        compress = {**compress, "rope_type": "yarn", **yarn, "attention_factor": 1.0}
    return {"main": main, "compress": compress}


def config_from_args(args: ModelArgs, max_position_embeddings: int | None) -> dict[str, Any]:
    ca, moe = args.compressed_attention, args.moe
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "moe_intermediate_size": moe.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": 1,
        "head_dim": args.head_dim,
        "qk_rope_head_dim": args.rope_dim,
        "partial_rotary_factor": args.rope_dim / args.head_dim,
        "q_lora_rank": ca.q_lora_rank,
        "o_groups": ca.o_groups,
        "o_lora_rank": ca.o_lora_rank,
        "sliding_window": args.sliding_window,
        "layer_types": list(args.layer_types),
        "compress_rates": {CSA: ca.csa_rate, HCA: ca.hca_rate},
        "index_n_heads": ca.index_n_heads,
        "index_head_dim": ca.index_head_dim,
        "index_topk": ca.index_topk,
        "hc_mult": ca.hc_mult,
        "hc_sinkhorn_iters": ca.hc_sinkhorn_iters,
        "hc_eps": ca.hc_eps,
        "mlp_layer_types": ["hash_moe" if i < ca.hash_layers else "moe" for i in range(args.n_layers)],
        "n_routed_experts": moe.num_experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": moe.top_k,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": float(moe.route_scale),
        "swiglu_limit": float(moe.swiglu_limit),
        "rope_theta": float(args.rope_theta),
        "compress_rope_theta": float(ca.compress_rope_theta),
        "rope_parameters": _rope_parameters(args),
        "max_position_embeddings": max_position_embeddings or args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": args.tie_embeddings,
        "num_nextn_predict_layers": args.mtp_layers,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def _layer_types(cfg: ConfigJson, n_layers: int) -> tuple[str, ...]:
    types = cfg.strings("layer_types", length=n_layers, choices=ATTENTION_TYPES)
    if types is not None:
        return tuple(types)
    ratios = cfg.get("compress_ratios")
    if ratios is not None:
        if not isinstance(ratios, list) or len(ratios) < n_layers or any(r not in _RATIO_TO_TYPE for r in ratios):
            raise CheckpointError(f"{cfg.where}: compress_ratios is {ratios!r:.60}, expected {n_layers} or more of "
                                  f"{', '.join(map(str, _RATIO_TO_TYPE))} (one per layer)")
        return tuple(_RATIO_TO_TYPE[r] for r in ratios[:n_layers])  # DeepSeek's list covers the MTP layer too
    rest = tuple(CSA if i % 2 else HCA for i in range(max(n_layers - 2, 0)))
    return ((HCA,) * min(n_layers, 2) + rest)[:n_layers]  # transformers' default schedule


def _hash_layers(cfg: ConfigJson, n_layers: int) -> int:
    types = cfg.strings("mlp_layer_types", length=n_layers, choices=MLP_TYPES)
    if types is None:
        return min(cfg.integer("num_hash_layers", 3, minimum=0), n_layers)
    hashed = types.count("hash_moe")
    if types != ["hash_moe"] * hashed + ["moe"] * (n_layers - hashed):
        raise CheckpointError(f"{cfg.where}: mlp_layer_types {types!r:.60}: titanctl's DeepSeek-V4 routes the first "
                              "layers by hash and the rest by score (hash_moe entries, then moe)")
    return hashed


def _compress_rope(cfg: ConfigJson) -> tuple[float, tuple[float, int, float, float] | None]:
    """(theta, YaRN) of the compressed branches: transformers' nested rope_parameters.compress, or the flat
    rope_scaling / rope_parameters DeepSeek's config and transformers' own arguments have."""
    nested = cfg.section("rope_parameters")
    params = nested.section("compress") if nested.has("compress") else cfg.section("rope_scaling", "rope_parameters")
    theta = params.number("rope_theta", cfg.number("compress_rope_theta", 160000.0, above=0), above=0)
    rope_type = params.text("rope_type", params.text("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise CheckpointError(f"{cfg.where}: compressed RoPE type {rope_type!r}: DeepSeek-V4's is 'default' or 'yarn'")
    if params.number("attention_factor", 1.0, above=0) != 1.0 or params.number("mscale", 0.0, minimum=0) or \
            params.number("mscale_all_dim", 0.0, minimum=0) or not params.flag("truncate", True):
        raise CheckpointError(f"{cfg.where}: YaRN with attention_factor, mscale or truncate=false is not "
                              "DeepSeek-V4's (its cos/sin are unscaled)")
    yarn = (params.number("factor", minimum=1),
            params.integer("original_max_position_embeddings", 0, minimum=0)
            or cfg.integer("max_position_embeddings", minimum=1),
            params.number("beta_fast", 0.0, minimum=0) or 32.0, params.number("beta_slow", 0.0, minimum=0) or 1.0)
    return theta, yarn


def _main_theta(cfg: ConfigJson) -> float:
    nested = cfg.section("rope_parameters")
    if nested.has("main"):
        main = nested.section("main")
        if main.text("rope_type", main.text("type", "default")) != "default":
            raise CheckpointError(f"{cfg.where}: rope_parameters.main.rope_type {main.get('rope_type')!r}: "
                                  "DeepSeek-V4's sliding-window RoPE is unscaled ('default')")
        return main.number("rope_theta", cfg.number("rope_theta", 10000.0, above=0), above=0)
    return cfg.number("rope_theta", 10000.0, above=0)


def _check_fixed(cfg: ConfigJson) -> None:
    """What titanctl's DeepSeek-V4 always is: one KV head, one shared expert, sqrt(softplus) scores
    renormalized, SiLU, no biases."""
    for key, value, default in (("num_key_value_heads", 1, 1), ("n_shared_experts", 1, 1)):
        if cfg.integer(key, default, minimum=0) != value:
            raise CheckpointError(f"{cfg.where}: {key} {cfg.get(key)}: DeepSeek-V4 has {value}")
    if cfg.text("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise CheckpointError(f"{cfg.where}: scoring_func {cfg.get('scoring_func')!r}: titanctl's DeepSeek-V4 "
                              "scores experts by sqrt(softplus) ('sqrtsoftplus')")
    if not cfg.flag("norm_topk_prob", True):
        raise CheckpointError(f"{cfg.where}: norm_topk_prob false: DeepSeek-V4 renormalizes the chosen weights")
    if cfg.text("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{cfg.where}: hidden_act {cfg.get('hidden_act')!r} is not DeepSeek-V4's 'silu'")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.flag(flag, False):
            raise CheckpointError(f"{cfg.where}: {flag}=true: DeepSeek-V4 has no biases")


def args_from_config(config: dict[str, Any], max_seq_len: int | None, where: str) -> ModelArgs:
    cfg = ConfigJson(config, where)
    _check_fixed(cfg)
    n_layers = cfg.integer("num_hidden_layers", minimum=1)
    head_dim = cfg.integer("head_dim", minimum=2)
    if cfg.has("partial_rotary_factor"):
        rope_dim = cfg.number("partial_rotary_factor", above=0) * head_dim
        if rope_dim != int(rope_dim):
            raise CheckpointError(f"{where}: partial_rotary_factor {cfg.get('partial_rotary_factor')} of head_dim "
                                  f"{head_dim} is no whole number of channels")
        rope_dim = int(rope_dim)
    else:
        rope_dim = cfg.integer("qk_rope_head_dim", 64, minimum=2)
    rates = cfg.section("compress_rates")
    compress_theta, compress_yarn = _compress_rope(cfg)
    attention = CompressedAttentionArgs(
        q_lora_rank=cfg.integer("q_lora_rank", minimum=1), o_groups=cfg.integer("o_groups", minimum=1),
        o_lora_rank=cfg.integer("o_lora_rank", minimum=1),
        csa_rate=rates.integer(CSA, cfg.integer("compress_rate_csa", 4, minimum=1), minimum=1),
        hca_rate=rates.integer(HCA, cfg.integer("compress_rate_hca", 128, minimum=1), minimum=1),
        index_n_heads=cfg.integer("index_n_heads", minimum=1), index_head_dim=cfg.integer("index_head_dim", minimum=1),
        index_topk=cfg.integer("index_topk", minimum=1), compress_rope_theta=compress_theta,
        compress_yarn=compress_yarn, hc_mult=cfg.integer("hc_mult", 4, minimum=1),
        hc_sinkhorn_iters=cfg.integer("hc_sinkhorn_iters", 20, minimum=1),
        hc_eps=cfg.number("hc_eps", 1e-6, above=0), hash_layers=_hash_layers(cfg, n_layers))
    experts = "n_routed_experts" if cfg.has("n_routed_experts") else "num_local_experts"
    moe = v4_moe(num_experts=cfg.integer(experts, minimum=1), top_k=cfg.integer("num_experts_per_tok", minimum=1),
                 hidden_dim=cfg.integer("moe_intermediate_size", minimum=1))
    moe = dataclasses.replace(moe, route_scale=cfg.number("routed_scaling_factor", 1.5, above=0),
                              swiglu_limit=cfg.number("swiglu_limit", 10.0, above=0))
    if not 1 <= moe.top_k <= moe.num_experts:
        raise CheckpointError(f"{where}: num_experts_per_tok {moe.top_k} must be 1 to n_routed_experts "
                              f"{moe.num_experts}")
    args = deepseek_v4_args(
        dim=cfg.integer("hidden_size", minimum=1), n_layers=n_layers,
        n_heads=cfg.integer("num_attention_heads", minimum=1), head_dim=head_dim, rope_dim=rope_dim,
        window=cfg.integer("sliding_window", 128, minimum=1), attention=attention, moe=moe,
        vocab_size=cfg.integer("vocab_size", minimum=1), layer_types=_layer_types(cfg, n_layers))
    args = args.replace(
        norm_eps=cfg.number("rms_norm_eps", 1e-6, above=0), rope_theta=_main_theta(cfg),
        mtp_layers=cfg.integer("num_nextn_predict_layers", 0, minimum=0),
        tie_embeddings=cfg.flag("tie_word_embeddings", False),
        max_seq_len=max_seq_len or cfg.integer("max_position_embeddings", 0, minimum=0) or ModelArgs.max_seq_len)
    try:
        v4_args(args).check()
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from None
    return args


HF = HFFormat(
    model_type="deepseek_v4",
    architecture="DeepseekV4ForCausalLM",
    layer_names={**ATTENTION_NAMES, **MOE_NAMES, **BLOCK_NAMES},
    top_names=TOP_NAMES,
    config_from_args=config_from_args,
    args_from_config=args_from_config,
    per_expert=PER_EXPERT,
    unprefixed_names=PUBLISHED_TOP_NAMES,
    mtp_names=MTP_NAMES,
)

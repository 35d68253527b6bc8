"""DeepSeek-V3 as Hugging Face's ``DeepseekV3ForCausalLM``: names (routed experts one tensor per expert,
as the published checkpoint and ``save_pretrained`` store them; transformers 5's packed tensors read
too, as for Qwen3-MoE), and config.json.

transformers' DeepSeek-V3 rotates the rope slice of each head in DeepSeek's interleaved pairs
(``rope_interleave``, true by default), as titanctl does: the weights load by renaming alone. Its
router always scores with a sigmoid and limits experts to the best groups; the expert bias is stored
(``e_score_correction_bias``). Multi-token prediction (``num_nextn_predict_layers``): depth k is
``model.layers.{n + k}`` (its block under the usual names, plus ``enorm``, ``hnorm``, ``eh_proj`` and
``shared_head.norm``); the ``embed_tokens`` and ``shared_head.head`` stored there are the main
model's (DeepSeek-V3 shares them), so they are not read, and exports do not write them.
"""

from __future__ import annotations

from typing import Any

from titanctl.errors import CheckpointError
from titanctl.models.common.args import MLAArgs, ModelArgs, MoEArgs
from titanctl.models.common.hf_config import (
    DECODER_LAYER_NAMES,
    DECODER_TOP_NAMES,
    DEFAULT_THETA,
    ConfigJson,
    check_plain_decoder,
    decoder_args,
    yarn_from_config,
)
from titanctl.models.qwen3_moe.hf import PACKED, PER_EXPERT
from titanctl.models.spec import HFFormat

MLA_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",  # q_lora_rank 0
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
MOE_NAMES = {
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.experts.w2": "mlp.experts.down_proj",  # packed (E, dim, hidden), as titanctl's: read only
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
# The dense first layers' FFN and both norms keep the shared decoder's names.
_SHARED = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight", "attention_norm.weight",
           "ffn_norm.weight")


def _rope_config(args: ModelArgs) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(4.x rope_scaling, 5.x rope_parameters)."""
    theta = float(args.rope_theta)
    yarn = args.yarn
    if yarn is None:
        return None, {"rope_type": "default", "rope_theta": theta}
    scaling = {
        "type": "yarn",  # DeepSeek's own config.json key (its remote code), beside transformers' rope_type
        "rope_type": "yarn",
        "factor": float(yarn.factor),
        "original_max_position_embeddings": int(yarn.original_max_position_embeddings),
        "beta_fast": float(yarn.beta_fast),
        "beta_slow": float(yarn.beta_slow),
        "mscale": float(yarn.mscale),
        "mscale_all_dim": float(yarn.mscale_all_dim),
    }
    return scaling, {**scaling, "rope_theta": theta}


def config_from_args(args: ModelArgs, max_position_embeddings: int | None) -> dict[str, Any]:
    moe, mla = args.moe, args.mla
    if moe.score_func != "sigmoid":
        raise CheckpointError(f"Hugging Face's DeepseekV3ForCausalLM scores experts with a sigmoid; this "
                              f"{args.family} model uses {moe.score_func} (e.g. flavor 16B): no such checkpoint")
    rope_scaling, rope_parameters = _rope_config(args)
    if max_position_embeddings is None:  # the extended context, as DeepSeek-V3 publishes it (163840)
        extended = args.yarn.original_max_position_embeddings * args.yarn.factor if args.yarn else 0
        max_position_embeddings = max(args.max_seq_len, int(extended))
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "moe_intermediate_size": moe.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "n_shared_experts": moe.num_shared_experts,
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "routed_scaling_factor": float(moe.route_scale),
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "norm_topk_prob": moe.norm_topk_prob,
        "first_k_dense_replace": moe.first_dense_layers,
        "moe_layer_freq": 1,
        "scoring_func": "sigmoid",  # read by DeepSeek's own code; transformers has no other
        "topk_method": "noaux_tc",
        "q_lora_rank": mla.q_lora_rank or None,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_interleave": args.rope_layout == "interleaved",
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": float(args.rope_theta),
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": args.tie_embeddings,
        "num_nextn_predict_layers": args.mtp_layers,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def args_from_config(config: dict[str, Any], max_seq_len: int | None, where: str) -> ModelArgs:
    cfg = ConfigJson(config, where)
    declared = decoder_args(cfg, "deepseek_v3", max_seq_len)
    check_plain_decoder(cfg, "DeepSeek-V3")
    if cfg.integer("moe_layer_freq", 1) != 1:
        raise CheckpointError(f"{where}: moe_layer_freq {cfg.get('moe_layer_freq')}: every layer after the dense ones "
                              "is sparse in DeepSeek-V3")
    if cfg.text("scoring_func", "sigmoid") != "sigmoid":
        raise CheckpointError(f"{where}: scoring_func {cfg.get('scoring_func')!r}: transformers' DeepSeek-V3 scores "
                              "experts with a sigmoid, so does titanctl")
    theta, yarn = yarn_from_config(cfg, "DeepSeek-V3", DEFAULT_THETA, takes_mscale=True, takes_truncate=False)
    mla = MLAArgs(
        q_lora_rank=cfg.integer("q_lora_rank", 0, minimum=0),
        kv_lora_rank=cfg.integer("kv_lora_rank", minimum=1),
        qk_nope_head_dim=cfg.integer("qk_nope_head_dim", minimum=1),
        qk_rope_head_dim=cfg.integer("qk_rope_head_dim", minimum=1),
        v_head_dim=cfg.integer("v_head_dim", minimum=1),
    )
    experts = "n_routed_experts" if cfg.has("n_routed_experts") else "num_local_experts"
    moe = MoEArgs(
        num_experts=cfg.integer(experts, minimum=1),
        top_k=cfg.integer("num_experts_per_tok", minimum=1),
        hidden_dim=cfg.integer("moe_intermediate_size", minimum=1),
        score_func="sigmoid",
        norm_topk_prob=cfg.flag("norm_topk_prob", False),
        route_scale=cfg.number("routed_scaling_factor", 1.0, above=0),
        num_shared_experts=cfg.integer("n_shared_experts", 0, minimum=0),
        first_dense_layers=cfg.integer("first_k_dense_replace", 0, minimum=0),
        n_group=cfg.integer("n_group", 0, minimum=0) or 1,
        topk_group=cfg.integer("topk_group", 0, minimum=0) or 1,
    )
    if not 1 <= moe.top_k <= moe.num_experts:
        raise CheckpointError(f"{where}: num_experts_per_tok {moe.top_k} must be 1 to n_routed_experts "
                              f"{moe.num_experts}")
    return declared.replace(
        n_kv_heads=None,  # MLA expands one latent into every head's key and value
        explicit_head_dim=mla.qk_head_dim, explicit_ffn_hidden_dim=cfg.integer("intermediate_size", minimum=1),
        mla=mla, moe=moe, rope_theta=theta, rope_scaling=None, yarn=yarn,
        rope_layout="interleaved" if cfg.flag("rope_interleave", True) else "halves",
        mtp_layers=cfg.integer("num_nextn_predict_layers", 0, minimum=0),
    )


HF = HFFormat(
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    layer_names={**{k: DECODER_LAYER_NAMES[k] for k in _SHARED}, **MLA_NAMES, **MOE_NAMES},
    top_names=DECODER_TOP_NAMES,
    config_from_args=config_from_args,
    args_from_config=args_from_config,
    packed=PACKED,
    per_expert=PER_EXPERT,
    mtp_names={"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
               "norm.weight": "shared_head.norm.weight"},
    mtp_shared=("embed_tokens.weight", "shared_head.head.weight"),
)

"""Qwen3-Next as Hugging Face's ``Qwen3NextForCausalLM`` (model_type ``qwen3_next``): names and config.json.

Qwen3.5-MoE's names (``self_attn.*``, ``linear_attn.*``, experts one tensor per expert, ``mlp.shared_expert*``)
but for the fused Gated DeltaNet projections, ``linear_attn.in_proj_qkvz`` and ``in_proj_ba``, which titanctl
stores as they are (per key-head group: gated_deltanet.py) and so reads by renaming alone. The conv's
channels, [all q | all k | all v] there too, are reordered per key-head group as Qwen3.5's. Dense blocks
(``mlp_only_layers``) are ``mlp.{gate,up,down}_proj``. The release's multi-token-prediction weights
(``mtp.*``) are not part of ``Qwen3NextForCausalLM`` (transformers skips them on load).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.hf_config import ConfigJson
from titanctl.models.qwen3_5 import hf as qwen3_5_hf
from titanctl.models.qwen3_5_moe import hf as qwen3_5_moe_hf
from titanctl.models.qwen3_moe import hf as qwen3_moe_hf
from titanctl.models.spec import HFFormat

FUSED_NAMES = {
    "attention.wqkvz.weight": "linear_attn.in_proj_qkvz.weight",
    "attention.wba.weight": "linear_attn.in_proj_ba.weight",
}
UNFUSED = ("attention.wqkv.weight", "attention.wz.weight", "attention.wb.weight", "attention.wa.weight")
LAYER_NAMES = {**{k: v for k, v in qwen3_5_hf.LAYER_NAMES.items() if k not in UNFUSED}, **FUSED_NAMES,
               **qwen3_moe_hf.MOE_NAMES, **qwen3_5_moe_hf.SHARED_EXPERT_NAMES}


def config_from_args(args: ModelArgs, max_position_embeddings: int | None) -> dict[str, Any]:
    moe = args.moe
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        **qwen3_5_hf.hybrid_config(args, max_position_embeddings),  # intermediate_size: the dense blocks'
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.hidden_dim,
        "shared_expert_intermediate_size": moe.hidden_dim * moe.num_shared_experts,
        "norm_topk_prob": moe.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(moe.first_dense_layers)),
        "router_aux_loss_coef": 0.001,
    }


def dense_prefix(cfg: ConfigJson, n_layers: int) -> int:
    """How many first layers are dense, from ``mlp_only_layers`` and ``decoder_sparse_step``: titanctl's
    MoE decoders have dense layers first, then MoE in every layer (one line refusing other schedules)."""
    step = cfg.integer("decoder_sparse_step", 1, minimum=1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise CheckpointError(f"{cfg.where}: mlp_only_layers {dense!r} must be a list of layer indices")
    first = len(set(dense))
    if sorted(set(dense)) != list(range(first)) or first > n_layers:
        raise CheckpointError(f"{cfg.where}: mlp_only_layers {dense} must be the first layers (0, 1, ...) of the "
                              f"{n_layers}: titanctl's MoE decoders are dense only there")
    if step != 1 and first < n_layers:
        raise CheckpointError(f"{cfg.where}: decoder_sparse_step {step} (MoE in every {step}th layer) is not "
                              "supported: titanctl has MoE in every layer after the dense ones (step 1)")
    return first


def args_from_config(config: dict[str, Any], max_seq_len: int | None, where: str) -> ModelArgs:
    cfg = ConfigJson(config, where)
    args = qwen3_5_moe_hf.moe_hybrid_args(cfg, "qwen3_next", max_seq_len, "Qwen3-Next")
    dense_ffn = cfg.integer("intermediate_size", 5632, minimum=1)  # transformers' default
    moe = dataclasses.replace(args.moe, norm_topk_prob=cfg.flag("norm_topk_prob", True),
                              first_dense_layers=dense_prefix(cfg, args.n_layers))
    return args.replace(explicit_ffn_hidden_dim=dense_ffn, moe=moe)


HF = HFFormat(
    model_type="qwen3_next",
    architecture="Qwen3NextForCausalLM",
    layer_names=LAYER_NAMES,
    top_names=qwen3_5_hf.HF.top_names,
    config_from_args=config_from_args,
    args_from_config=args_from_config,
    packed=qwen3_moe_hf.PACKED,
    per_expert=qwen3_moe_hf.PER_EXPERT,
    not_stored=("moe.expert_bias",),
    reordered_rows={"attention.conv.weight": qwen3_5_hf.GROUPED_ROWS["attention.conv.weight"]},
)

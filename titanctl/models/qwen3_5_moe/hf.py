"""Qwen3.5-MoE as Hugging Face's ``Qwen3_5MoeForCausalLM`` (model_type ``qwen3_5_moe_text``): names and config.json.

Routed experts are one tensor per expert on disk (``mlp.experts.{e}.gate_proj.weight``, ...), as
Qwen3-MoE's; transformers 5's in-memory packed ``gate_up_proj`` / ``down_proj`` read too. The shared
expert is ``mlp.shared_expert.*`` and its gate ``mlp.shared_expert_gate.weight``.
"""

from __future__ import annotations

from typing import Any

from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs, MoEArgs
from titanctl.models.common.hf_config import ConfigJson
from titanctl.models.qwen3_5 import hf as qwen3_5_hf
from titanctl.models.qwen3_moe import hf as qwen3_moe_hf
from titanctl.models.spec import HFFormat

SHARED_EXPERT_NAMES = {
    "moe.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
    "moe.shared_gate.weight": "mlp.shared_expert_gate.weight",
}


def config_from_args(args: ModelArgs, max_position_embeddings: int | None) -> dict[str, Any]:
    moe = args.moe
    config = qwen3_5_hf.hybrid_config(args, max_position_embeddings)
    config.pop("intermediate_size")  # the MoE config has none (its widths are the experts')
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        **config,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.hidden_dim,
        "shared_expert_intermediate_size": moe.hidden_dim * moe.num_shared_experts,
        "router_aux_loss_coef": 0.001,
    }


def moe_hybrid_args(cfg: ConfigJson, family: str, max_seq_len: int | None, what: str) -> ModelArgs:
    """ModelArgs of a hybrid MoE decoder's config.json (the keys ``config_from_args`` writes), each refusal
    one line; every block MoE, the dense width the experts'."""
    config, where = cfg.cfg, cfg.where
    expert_ffn = cfg.integer("moe_intermediate_size", minimum=1)
    shared = cfg.integer("shared_expert_intermediate_size", expert_ffn, minimum=1)
    if shared != expert_ffn:
        raise CheckpointError(f"{where}: shared_expert_intermediate_size {shared} differs from moe_intermediate_size "
                              f"{expert_ffn}: titanctl's shared expert is one routed expert's width")
    dense = qwen3_5_hf.hybrid_args(ConfigJson({**config, "intermediate_size": expert_ffn}, where), family,
                                   max_seq_len, what)
    moe = MoEArgs(num_experts=cfg.integer("num_experts", minimum=1),
                  top_k=cfg.integer("num_experts_per_tok", minimum=1), hidden_dim=expert_ffn, num_shared_experts=1,
                  shared_expert_gate=True)
    if not 1 <= moe.top_k <= moe.num_experts:
        raise CheckpointError(f"{where}: num_experts_per_tok {moe.top_k} must be 1 to num_experts {moe.num_experts}")
    return dense.replace(moe=moe)


def args_from_config(config: dict[str, Any], max_seq_len: int | None, where: str) -> ModelArgs:
    return moe_hybrid_args(ConfigJson(config, where), "qwen3_5_moe", max_seq_len, "Qwen3.5-MoE")


HF = HFFormat(
    model_type="qwen3_5_moe_text",
    architecture="Qwen3_5MoeForCausalLM",
    layer_names={**{k: v for k, v in qwen3_5_hf.LAYER_NAMES.items() if k not in qwen3_moe_hf.DENSE_ONLY},
                 **qwen3_moe_hf.MOE_NAMES, **SHARED_EXPERT_NAMES},
    top_names=qwen3_5_hf.HF.top_names,
    config_from_args=config_from_args,
    args_from_config=args_from_config,
    packed=qwen3_moe_hf.PACKED,
    per_expert=qwen3_moe_hf.PER_EXPERT,
    not_stored=("moe.expert_bias",),
    reordered_rows=qwen3_5_hf.GROUPED_ROWS,
)

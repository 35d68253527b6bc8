"""Qwen3-MoE as Hugging Face's ``Qwen3MoeForCausalLM``: names and config.json.

Routed experts are one tensor per expert on disk (``mlp.experts.{e}.gate_proj.weight``, ...), as
``save_pretrained`` writes them and the Hub, vLLM, SGLang and transformers 4.x read them: exports
write that. Folders holding transformers 5's in-memory packed tensors (``mlp.experts.gate_up_proj``
[E, 2F, D], ``mlp.experts.down_proj`` [E, D, F]) read too."""

from __future__ import annotations

from typing import Any

from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs, MoEArgs
from titanctl.models.common.hf_config import ConfigJson
from titanctl.models.qwen3 import hf as qwen3_hf
from titanctl.models.spec import HFFormat

MOE_NAMES = {
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.experts.w2": "mlp.experts.down_proj",  # packed (E, dim, hidden), as titanctl's: read only
}
# transformers 5's packed gate_up_proj (E, 2 * hidden, dim), the gate's rows first: read only.
PACKED = {
    "moe.experts.w1": ("mlp.experts.gate_up_proj", 1, 0, 2),
    "moe.experts.w3": ("mlp.experts.gate_up_proj", 1, 1, 2),
}
# The Hub's layout, read and written.
PER_EXPERT = {
    "moe.experts.w1": "mlp.experts.{e}.gate_proj.weight",
    "moe.experts.w3": "mlp.experts.{e}.up_proj.weight",
    "moe.experts.w2": "mlp.experts.{e}.down_proj.weight",
}
# A dense block's FFN, which an MoE block has not (Qwen3.5-MoE drops the same names).
DENSE_ONLY = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")


def config_from_args(args: ModelArgs, max_position_embeddings: int | None) -> dict[str, Any]:
    moe = args.moe
    return {
        **qwen3_hf.config_from_args(args, max_position_embeddings),
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": moe.num_experts,  # transformers 5 reads it as num_local_experts
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.hidden_dim,
        "norm_topk_prob": moe.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def args_from_config(config: dict[str, Any], max_seq_len: int | None, where: str) -> ModelArgs:
    cfg = ConfigJson(config, where)
    if cfg.get("mlp_only_layers") or cfg.integer("decoder_sparse_step", 1) != 1:
        raise CheckpointError(f"{where}: dense layers among the sparse ones (mlp_only_layers, decoder_sparse_step) "
                              "are not supported: every Qwen3-MoE block is sparse")
    dense = qwen3_hf.args_from_config({**config, "model_type": "qwen3"}, max_seq_len, where)
    experts = "num_experts" if cfg.has("num_experts") else "num_local_experts"  # 4.x name, 5.x name
    moe = MoEArgs(num_experts=cfg.integer(experts, minimum=1), top_k=cfg.integer("num_experts_per_tok", minimum=1),
                  hidden_dim=cfg.integer("moe_intermediate_size", minimum=1),
                  norm_topk_prob=cfg.flag("norm_topk_prob", False))
    if not 1 <= moe.top_k <= moe.num_experts:
        raise CheckpointError(f"{where}: num_experts_per_tok {moe.top_k} must be 1 to num_experts {moe.num_experts}")
    return dense.replace(family="qwen3_moe", moe=moe, explicit_ffn_hidden_dim=moe.hidden_dim)


HF = HFFormat(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    layer_names={k: v for k, v in {**qwen3_hf.HF.layer_names, **MOE_NAMES}.items() if k not in DENSE_ONLY},
    top_names=qwen3_hf.HF.top_names,
    config_from_args=config_from_args,
    args_from_config=args_from_config,
    packed=PACKED,
    per_expert=PER_EXPERT,
    not_stored=("moe.expert_bias",),
)

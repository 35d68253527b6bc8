"""torchtitan 0.3's names for the shared modules, where they are not titanctl's: the pieces each
family's ``TorchtitanNames`` is made of (read from torchtitan 0.3.0's ``models/common`` and
``models/deepseek_v3``; every other weight has the same name and the same layout in both).

- Grouped-query attention (``GQAttention``): the projections live in ``qkv_linear``; the fused
  ``FusedQKVLinear`` saves and loads its ``wqkv`` split into ``wq``/``wk``/``wv`` (state-dict hooks),
  so those are the names on disk either way. ``q_norm``/``k_norm`` (Qwen3) and ``wo`` keep theirs.
  DeepSeek-V3's latent attention is another module and keeps titanctl's names (``wq`` included).
- Mixture of Experts: the stacked experts are ``routed_experts.inner_experts`` with their shapes in
  the name (``w1_EFD``: experts x hidden x dim, as titanctl's ``w1``), the balancing bias is
  ``expert_bias_E``; the router's ``gate`` and the ``shared_experts`` keep titanctl's names.
- gpt-oss (0.3.0's ``models/gpt_oss``): its q/k/v biases split with the weights
  (``qkv_linear.{wq,wk,wv}.bias``); ``attention.sinks``, ``wo`` and the router's ``gate`` (bias
  included) keep titanctl's names; the experts are ``routed_experts.inner_experts`` as
  ``mlp1_weight_EGD`` (titanctl's ``w13``: gate and up rows interleaved, the same layout),
  ``mlp1_bias_EG``, ``mlp2_weight_EDF`` and ``mlp2_bias_ED``. (0.3.0's own Hugging Face adapter names
  them ``mlp1_weight`` etc., which its model does not have: checkpoints hold the model's names.)
- The output layer is ``lm_head``.
- Multi-token prediction (DeepSeek-V3): depth k is ``mtp_layers.{k}``, one module holding the depth's
  block (titanctl's ``layers.{n_layers + k}``) and its ``enorm``/``hnorm``/``eh_proj``/``mtp_norm``
  (titanctl's ``mtp.{k}``, whose ``norm`` is ``mtp_norm``).
"""

from __future__ import annotations

GQA_LAYER_NAMES = {f"attention.{w}.weight": f"attention.qkv_linear.{w}.weight" for w in ("wq", "wk", "wv")}
MOE_LAYER_NAMES = {
    "moe.experts.w1": "moe.routed_experts.inner_experts.w1_EFD",
    "moe.experts.w2": "moe.routed_experts.inner_experts.w2_EDF",
    "moe.experts.w3": "moe.routed_experts.inner_experts.w3_EFD",
    "moe.expert_bias": "moe.expert_bias_E",
}
TOP_NAMES = {"output.weight": "lm_head.weight"}
MTP_NAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "mtp_norm.weight",
}
GQA_BIAS_NAMES = {f"attention.{w}.bias": f"attention.qkv_linear.{w}.bias" for w in ("wq", "wk", "wv")}
GPT_OSS_EXPERT_NAMES = {
    "moe.experts.w13": "moe.routed_experts.inner_experts.mlp1_weight_EGD",
    "moe.experts.b13": "moe.routed_experts.inner_experts.mlp1_bias_EG",
    "moe.experts.w2": "moe.routed_experts.inner_experts.mlp2_weight_EDF",
    "moe.experts.b2": "moe.routed_experts.inner_experts.mlp2_bias_ED",
    "moe.expert_bias": "moe.expert_bias_E",
}

"""torchtitan 0.3's names for the shared modules, where they are not titanctl's: the pieces each
family's ``TorchtitanNames`` is made of (read from torchtitan 0.3.0's ``models/common``; every other
weight has the same name and the same layout in both; a family's own modules have their names in
its spec).

- Grouped-query attention (``GQAttention``): the projections live in ``qkv_linear``; the fused
  ``FusedQKVLinear`` saves and loads its ``wqkv`` split into ``wq``/``wk``/``wv`` (state-dict hooks),
  so those are the names on disk either way, and their biases split with the weights
  (``qkv_linear.{wq,wk,wv}.bias``). ``q_norm``/``k_norm`` and ``wo`` keep theirs.
- Mixture of Experts: the stacked experts are ``routed_experts.inner_experts`` with their shapes in
  the name (``w1_EFD``: experts x hidden x dim, as titanctl's ``w1``), the balancing bias is
  ``expert_bias_E``; the router's ``gate`` and the ``shared_experts`` keep titanctl's names.
- The output layer is ``lm_head``.
"""

from __future__ import annotations

GQA_LAYER_NAMES = {f"attention.{w}.weight": f"attention.qkv_linear.{w}.weight" for w in ("wq", "wk", "wv")}
GQA_BIAS_NAMES = {f"attention.{w}.bias": f"attention.qkv_linear.{w}.bias" for w in ("wq", "wk", "wv")}
EXPERT_BIAS_NAMES = {"moe.expert_bias": "moe.expert_bias_E"}
MOE_LAYER_NAMES = {
    "moe.experts.w1": "moe.routed_experts.inner_experts.w1_EFD",
    "moe.experts.w2": "moe.routed_experts.inner_experts.w2_EDF",
    "moe.experts.w3": "moe.routed_experts.inner_experts.w3_EFD",
    **EXPERT_BIAS_NAMES,
}
TOP_NAMES = {"output.weight": "lm_head.weight"}

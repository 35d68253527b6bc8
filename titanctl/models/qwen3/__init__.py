"""Qwen3 (dense): the shared decoder of ``titanctl.models.common`` with Qwen3's flavors.

Nothing here subclasses the model: every Qwen3 difference from Llama is a ModelArgs switch
(``qk_norm``, ``rope_layout``, ``explicit_head_dim``, ``explicit_ffn_hidden_dim``, ``tie_embeddings``),
so the TP plan (``titanctl.models.common.tp_plan``, with QK-norm entries), weight init, shapes and
parameter counts are the shared ones. Its spec is ``titanctl.models.qwen3.spec.SPEC``.
"""

"""Qwen3.5 (dense): a hybrid decoder, three Gated DeltaNet layers to every gated full-attention layer.
Its spec is ``titanctl.models.qwen3_5.spec.SPEC``; the MoE sizes are ``titanctl.models.qwen3_5_moe``."""

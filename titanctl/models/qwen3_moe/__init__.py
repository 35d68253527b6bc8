"""Qwen3-MoE: Qwen3's attention (per-head QK norm) with a Mixture of Experts in every block.
Its spec is ``titanctl.models.qwen3_moe.spec.SPEC``."""

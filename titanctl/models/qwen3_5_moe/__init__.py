"""Qwen3.5-MoE: Qwen3.5's hybrid blocks with a Mixture of Experts, and a gated shared expert, in every
block. Its spec is ``titanctl.models.qwen3_5_moe.spec.SPEC``."""

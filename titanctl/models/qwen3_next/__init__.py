"""Qwen3-Next: Qwen3.5-MoE's hybrid blocks with the Gated DeltaNet's input projections fused per key-head
group, dense FFNs allowed in the first layers. Its spec is ``titanctl.models.qwen3_next.spec.SPEC``."""

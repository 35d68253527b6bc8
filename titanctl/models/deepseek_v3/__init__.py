"""DeepSeek-V3: Multi-head Latent Attention (``titanctl.models.deepseek_v3.mla``) with YaRN RoPE, dense
first layers, then a Mixture of Experts with shared experts and sigmoid scores routed within the
best expert groups. Its spec is ``titanctl.models.deepseek_v3.spec.SPEC``."""

"""gpt-oss (OpenAI's gpt-oss-20b and -120b): grouped-query attention with biases, learned attention
sinks and sliding-window layers alternating with full ones, YaRN RoPE, and a Mixture of Experts whose
biased experts run a clamped SwiGLU. Its spec is ``titanctl.models.gpt_oss.spec.SPEC``."""

"""titanctl: pre-train and fine-tune decoder LLMs (Llama 3, Qwen3, Qwen3-MoE, DeepSeek-V3, gpt-oss) from one CPU
to thousands of GPUs."""

__version__ = "0.1.0"

from titanctl import _inductor_cache  # before anything imports torch's inductor

_inductor_cache.apply()

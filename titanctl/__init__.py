"""titanctl: pre-train Llama 3.1 models from one CPU to thousands of GPUs."""

__version__ = "0.1.0"

from titanctl import _inductor_cache  # before anything imports torch's inductor

_inductor_cache.apply()

"""titanctl: pre-train Llama 3.1 models from one CPU to thousands of GPUs."""

__version__ = "0.1.0"

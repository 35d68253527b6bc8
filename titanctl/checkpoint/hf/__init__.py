"""Hugging Face knowledge every format and export shares: names and config.json (``names``), the
source config carried through titanctl (``carried_config``), tokenizer files, what an export cannot
carry (``uncarried``), and which shapes vLLM's kernels take (``serving_kernels``)."""

"""Generation from a trained model: the decoding loop and its KV cache handling (``generate``), sampling,
chat prompts, and tensor parallel for decoding (``tensor_parallel``, its ranks exchanging through shared
memory on one host: ``shm_exchange``). ``titanctl infer-tp`` is its command."""

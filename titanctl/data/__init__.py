"""Data: tokenizers (tiktoken and Hugging Face tokenizer.json, and their download), the dataset registry,
chat conversations with their templates and loss masks, and the checkpointable, rank-sharded loader."""

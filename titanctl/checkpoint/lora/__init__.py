"""LoRA runs: the frozen base a run records and checks (``base``), and its adapters exported for peft or
merged into the base (``export``)."""

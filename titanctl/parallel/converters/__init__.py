"""Model converters, applied to the whole model on the meta device before any layout: Float8 linears,
oneDNN linears on CPU, LoRA adapters."""

"""Helpers for tests that compare titanctl with a transformers model built in-process."""

from __future__ import annotations

import math

import torch
from torch import nn


@torch.no_grad()
def unit_scale_(model: nn.Module, gen: torch.Generator) -> None:
    """Weights at unit scale (FACTS.md): routing and attention far from uniform, so that no logit or
    expert choice is near a tie that rounding could flip."""
    for name, p in model.named_parameters():
        if "embed" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        elif p.ndim >= 2:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        else:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))


def per_expert_layout(packed: dict[str, torch.Tensor], hidden: int) -> dict[str, torch.Tensor]:
    """A packed Hugging Face state dict (transformers 5's experts.gate_up_proj / down_proj) in the
    older one-tensor-per-expert names; ``hidden`` is the experts' hidden width."""
    out = {}
    for name, tensor in packed.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            for e in range(tensor.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = tensor[e, :hidden].clone()
                out[f"{base}{e}.up_proj.weight"] = tensor[e, hidden:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(tensor.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = tensor[e].clone()
        else:
            out[name] = tensor
    return out

"""How each parameter is initialized, said by the module that owns it.

A module that owns parameters answers ``param_inits(depth)``: {its parameter's name, relative to it
(``wq.weight``, ``sinks``): ``ParamInit``}, for the parameters it holds itself and those of its plain
torch children (``nn.Linear``, ``nn.Embedding``). ``depth`` is the std divisor of its block's output
projections (``TransformerBlock.init_depth``), None outside a block. ``init_rules`` gathers them over
a model; ``titanctl.parallel.layouts.weight_init.initialize_weights`` draws them, the same numbers
under every layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ParamInit:
    """How one parameter is initialized: ones, zeros, or a (truncated) normal or uniform draw."""

    kind: str  # "ones" | "zeros" | "normal" | "trunc_normal" | "uniform"
    std: float = 1.0
    bound: float = 2.0  # absolute truncation bound of "trunc_normal", half-width of "uniform"
    center: float = 0.0  # the middle of "uniform"'s interval


ONES = ParamInit("ones")
# What a block's branches take in (q/k/v, latent projections, the FFN's and experts' gate, the router)
# and small parameters that must not start at zero (biases, sinks): 0.02, as torchtitan draws them.
INPUT = ParamInit("trunc_normal", std=0.02)


def output_projection(depth: int) -> ParamInit:
    """A block's branch outputs (wo, w2, and w3 beside them): 0.02 / sqrt(2 x depth)."""
    return ParamInit("trunc_normal", std=0.02 / math.sqrt(2 * depth))


def init_rules(model: nn.Module) -> dict[str, ParamInit]:
    """{parameter name, as ``model.named_parameters()`` gives it (wrapper parts included): its init}."""
    rules: dict[str, ParamInit] = {}

    def gather(module: nn.Module, prefix: str, depth: int | None) -> None:
        # The module's own (a wrapper, e.g. activation checkpointing's, forwards attributes it lacks to the
        # module it wraps, which answers for itself under its own name).
        depth = vars(module).get("init_depth", depth)
        if hasattr(type(module), "param_inits"):
            rules.update({f"{prefix}{name}": spec for name, spec in module.param_inits(depth).items()})
        for name, child in module.named_children():
            gather(child, f"{prefix}{name}.", depth)

    gather(model, "", None)
    return rules

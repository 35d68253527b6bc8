"""The shape of every weight of a model: read off the model itself, built on the meta device.

This is the one source of truth for shapes: checkpoint checks, format conversion and the
parameter count all derive from it, so they cannot disagree with the model. Building on
the meta device allocates nothing; the cost is one Python module per layer, so callers that
take ModelArgs from a file check them against the file's tensors first
(``titanctl.checkpoint.trust.model_args``).

A tied model (``ModelArgs.tie_embeddings``) has one Parameter under two state-dict keys:
``weight_shapes`` lists both (``load_state_dict`` wants both), ``tied_weights`` says which key
is the alias, and ``num_params`` counts the Parameter once.
"""

from __future__ import annotations

import functools
import math

import torch

from titanctl.models.common.args import ModelArgs
from titanctl.models.registry import build_model

EMBEDDING = "tok_embeddings.weight"


@functools.lru_cache(maxsize=8)
def _layout(args: ModelArgs) -> tuple[dict[str, tuple[int, ...]], dict[str, str], frozenset[str], frozenset[str]]:
    with torch.device("meta"):
        model = build_model(args.replace(max_seq_len=1))  # the RoPE table is no weight
    buffers = frozenset(name for name, _ in model.named_buffers())  # saved state such as MoE's expert_bias
    shapes: dict[str, tuple[int, ...]] = {}
    first_name: dict[int, str] = {}  # id(tensor) -> the first key that holds it
    tied: dict[str, str] = {}
    integers = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        shapes[name] = tuple(tensor.shape)
        if not tensor.is_floating_point():
            integers.add(name)
        source = first_name.setdefault(id(tensor), name)
        if source != name:
            tied[name] = source
    return shapes, tied, buffers, frozenset(integers)


def weight_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """{canonical name: shape} of every state-dict key (saved buffers included), in the model's own
    order (a tied weight appears under both of its keys). Cached and shared: do not modify it."""
    return _layout(args)[0]


def integer_state(args: ModelArgs) -> frozenset[str]:
    """State-dict keys whose tensor holds integers, not weights (DeepSeek-V4's token -> experts tables):
    stored and loaded as they are, never cast to a weight dtype."""
    return _layout(args)[3]


def tied_weights(args: ModelArgs) -> dict[str, str]:
    """{alias key: the key it shares its tensor with}, e.g. {"output.weight": "tok_embeddings.weight"}
    for a tied model; empty otherwise."""
    return dict(_layout(args)[1])


def num_params(args: ModelArgs, include_embedding: bool = True) -> int:
    """Parameter count, from the weight shapes of the model; a tied weight counts once.

    ``include_embedding=False`` leaves out the embedding table when it is a lookup only (no matmul
    FLOPs: ``titanctl.train.flops`` counts 6 FLOPs per remaining parameter). A table tied to the
    output layer is that layer's matmul weight too, so it stays in.
    """
    shapes, tied, buffers, _ = _layout(args)
    lookup_only = EMBEDDING not in tied.values()
    return sum(
        math.prod(shape)
        for name, shape in shapes.items()
        if name not in tied and name not in buffers and (include_embedding or not (lookup_only and name == EMBEDDING))
    )

"""The shape of every weight of a model: read off the model itself, built on the meta device.

This is the one source of truth for shapes: checkpoint checks, format conversion and the
parameter count all derive from it, so they cannot disagree with the model. Building on
the meta device allocates nothing; the cost is one Python module per layer, so callers that
take ModelArgs from a file check them against the file's tensors first
(``titanctl.checkpoint.model_args``).
"""

from __future__ import annotations

import functools
import math

import torch

from titanctl.models.llama.args import ModelArgs
from titanctl.models.llama.model import Transformer

EMBEDDING = "tok_embeddings.weight"


@functools.lru_cache(maxsize=8)
def weight_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """{canonical (Meta) name: shape} of every weight, in the model's own order."""
    with torch.device("meta"):
        model = Transformer(args.replace(max_seq_len=1))  # the RoPE table is no weight
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def num_params(args: ModelArgs, include_embedding: bool = True) -> int:
    """Parameter count, from the weight shapes of the model."""
    return sum(
        math.prod(shape) for name, shape in weight_shapes(args).items() if include_embedding or name != EMBEDDING
    )

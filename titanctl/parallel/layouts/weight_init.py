"""Weight init that draws the same numbers under every parallel layout.

Each parameter gets its own generator, seeded from the run seed and the parameter's
canonical name, and is drawn whole on the CPU; every rank then keeps its own slice.
So one process, FSDP, TP and PP stages all start from bit-identical weights, with no
seed checkpoint. The cost is drawing each full parameter once per rank (one tensor at
a time, so peak host memory is the largest parameter, not the model).
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titanctl import _torch_compat
from titanctl.models.common.init import ParamInit, init_rules
from titanctl.parallel.converters.lora import adapter_init, is_adapter


def canonical_name(name: str) -> str:
    """A parameter name without the parts that wrappers (activation checkpointing, compile) put in."""
    for part in _torch_compat.WRAPPER_NAME_PARTS:
        name = name.replace(part, "")
    return name


def draw(shape: torch.Size, spec: ParamInit, seed: int, name: str) -> torch.Tensor:
    """The full fp32 value of one parameter, a pure function of (shape, spec, seed, name)."""
    full = torch.empty(shape, dtype=torch.float32)
    if spec.kind == "ones":
        return full.fill_(1.0)
    if spec.kind == "zeros":
        return full.zero_()
    # Modulo 2^64, the generator's seed range: the same numbers as ever for every seed below
    # 2^64 / 1_000_003, and no overflow for larger ones (training.seed goes up to 2^64 - 1).
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**64)
    if spec.kind == "normal":
        return nn.init.normal_(full, std=spec.std, generator=gen)
    if spec.kind == "uniform":
        return nn.init.uniform_(full, spec.center - spec.bound, spec.center + spec.bound, generator=gen)
    return nn.init.trunc_normal_(full, std=spec.std, a=-spec.bound, b=spec.bound, generator=gen)


@torch.no_grad()
def initialize_weights(
    model: nn.Module, seed: int, buffer_device: torch.device | None = None, *, adapters_only: bool = False
) -> None:
    """Initialize ``model`` (plain, FSDP/TP-sharded or a pipeline stage) deterministically.

    Each parameter is drawn as the module that owns it says (``titanctl.models.common.init``); ``model``
    must provide ``init_buffers(device)``. LoRA adapters are drawn as
    ``titanctl.parallel.converters.lora.adapter_init`` says. ``adapters_only``:
    only the adapters (their frozen base is loaded from a checkpoint).
    """
    model.init_buffers(buffer_device)
    rules = init_rules(model)
    for given_name, param in model.named_parameters():
        name = canonical_name(given_name)
        adapter = is_adapter(name)
        if adapters_only and not adapter:
            continue
        if adapter:
            spec = adapter_init(name, tuple(param.shape))
        elif given_name in rules:
            spec = rules[given_name]
        else:
            raise ValueError(f"no init rule for parameter {name!r}")
        full = draw(param.shape, spec, seed, name)
        if isinstance(param, DTensor):
            # Every rank drew the same full tensor, so slicing locally needs no communication.
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)

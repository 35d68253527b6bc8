"""Load a checkpoint of any format straight into a model, one tensor at a time.

The source (``titanctl.checkpoint.formats``: Hugging Face, torchtitan, Meta, torchtune, DCP)
is opened and bound with ``open_checkpoint``, so every tensor already has its canonical
name and layout (HF's q/k rows un-permuted, Meta's shards merged, torchtitan's names
mapped). Each full tensor is then read once per process and copied into the parameter:
a plain parameter takes it whole; a sharded one (a ``DTensor`` of FSDP2, TP or both) keeps
only its own slice, cut locally by ``distribute_tensor(..., src_data_rank=None)``. Every
rank reads the same full tensor, so no rank needs another's data: no communication, no
converted copy on disk. A pipeline stage holds only some layers: the tensors of the other
layers are never read. Peak memory beyond the model is one full tensor (plus the
source's read buffer: up to 256 MiB of look-ahead for a DCP source).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titanctl.checkpoint.formats.base import Source
from titanctl.errors import CheckpointError
from titanctl.parallel.layouts.weight_init import canonical_name


@dataclass
class LoadReport:
    loaded: list[str] = field(default_factory=list)  # canonical names copied into the model
    not_in_model: list[str] = field(default_factory=list)  # source tensors this model (stage) has no place for


def _loadable(model: nn.Module, keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The parameters and persistent buffers of `model` by canonical name: what its state dict holds
    (an MoE's expert bias is a buffer that decides the routing), each tied tensor once; with ``keep``,
    those whose name it accepts."""
    saved = {canonical_name(name) for name in model.state_dict(keep_vars=True)}
    tensors = {canonical_name(name): param for name, param in model.named_parameters()}
    tensors.update(
        (canonical_name(name), buffer) for name, buffer in model.named_buffers() if canonical_name(name) in saved
    )
    return tensors if keep is None else {name: t for name, t in tensors.items() if keep(name)}


@torch.no_grad()
def load_source_into(model: nn.Module, source: Source, keep: Callable[[str], bool] | None = None) -> LoadReport:
    """Copy every parameter of `model` from the bound `source` (see the module docstring); with
    ``keep``, those whose canonical name it accepts (a LoRA model's base, not its adapters).

    Raises ``CheckpointError`` before copying anything if the model has a parameter (or persistent
    buffer) the source lacks or one whose (global) shape differs.
    """
    if source.args is None:
        raise ValueError("bind the source first (open_checkpoint does)")
    params = _loadable(model, keep)
    infos = {info.name: info for info in source.infos}
    for name, param in params.items():
        info = infos.get(name)
        if info is None:
            raise CheckpointError(f"checkpoint {source.folder} has no tensor {name!r}, which the model has")
        if tuple(param.shape) != tuple(info.shape):
            raise CheckpointError(
                f"tensor {info.shown!r} in {info.where} has shape {tuple(info.shape)}, the model's "
                f"{name!r} has {tuple(param.shape)}"
            )
    report = LoadReport()
    for info in source.infos:  # the order that reads the source best
        param = params.get(info.name)
        if param is None:
            report.not_in_model.append(info.name)
            continue
        full = source.load(info.name).to(param.dtype)
        if isinstance(param, DTensor):
            # Every rank holds the same full tensor: each cuts its own slice, nothing is sent.
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)
        del full
        report.loaded.append(info.name)
    return report

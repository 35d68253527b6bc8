"""Reductions that every layout needs: the global loss and the global gradient norm."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanctl.parallel.dims import ParallelDims


def global_mean_loss(loss: torch.Tensor | None, dims: ParallelDims) -> torch.Tensor:
    """The loss of the global batch, known on every rank.

    Each data-parallel/context-parallel position has its loss on the last pipeline stage,
    replicated over its tp ranks: sum over the world, then divide by those copies.
    """
    if isinstance(loss, DTensor):  # loss parallel: a replicated scalar over the tp mesh
        loss = loss.full_tensor()
    if dims.world_size == 1:
        return loss
    value = loss.detach().clone() if loss is not None else torch.zeros((), device=_device())
    dist.all_reduce(value)
    return value / (dims.tp * dims.dp * dims.cp)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float, dims: ParallelDims) -> torch.Tensor:
    """Clip by the norm over all parameters of the model, whichever ranks hold them."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(norm, DTensor):  # sharded grads: a partial norm, reduced over the mesh
        norm = norm.full_tensor()
    if dims.pp > 1:  # each stage holds different parameters
        squared = norm**2
        dist.all_reduce(squared, group=dims.mesh["pp"].get_group())
        norm = squared.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm

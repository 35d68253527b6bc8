"""Reductions that every layout needs: the global loss and the global gradient norm.

None of them reads a value on the host: the Trainer does that only on log steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanctl.parallel.layouts.dims import ParallelDims


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


class StepLosses:
    """Each step's loss stays a device tensor; reading it is a host sync, so the Trainer reads it
    only on log steps (and before a checkpoint is written). Between reads it remembers, on the
    device, the first step whose loss was not finite, so divergence is still caught at the next read.
    """

    # The first bad step s with its value's kind k (1 nan, 2 +inf, 3 -inf) is kept as
    # (_NEVER - s) * 4 + k, 0 meaning none: a MAX all-reduce then finds the earliest on any rank.
    _NEVER = 2**60
    _KINDS = {1: float("nan"), 2: float("inf"), 3: float("-inf")}

    def __init__(self) -> None:
        self.last: torch.Tensor | None = None
        self._first_bad: torch.Tensor | None = None

    def record(self, step: int, loss: torch.Tensor | None) -> None:
        """This rank's loss of ``step`` (None off the last pipeline stage); no host sync."""
        if loss is None:
            return
        if isinstance(loss, DTensor):  # loss parallel: replicated over the tp mesh
            loss = loss.full_tensor()
        self.last = loss.detach()
        if self._first_bad is None:
            self._first_bad = torch.zeros((), dtype=torch.int64, device=loss.device)
        kind = torch.where(torch.isnan(self.last), 1, torch.where(self.last > 0, 2, 3))
        newly_bad = ~torch.isfinite(self.last) & (self._first_bad == 0)
        self._first_bad = torch.where(newly_bad, (self._NEVER - step) * 4 + kind, self._first_bad)

    def read(self, dims: ParallelDims) -> tuple[float, tuple[int, float] | None]:
        """(global mean loss of the last recorded step, (step, value) of the first non-finite loss
        on any rank since the run started, or None). Every rank must call it at the same steps:
        it runs collectives."""
        loss = global_mean_loss(self.last, dims)
        first_bad = torch.zeros((), dtype=torch.int64, device=loss.device)
        if self._first_bad is not None:
            first_bad.copy_(self._first_bad)
        if dims.world_size > 1:
            dist.all_reduce(first_bad, op=dist.ReduceOp.MAX)
        marker = int(first_bad.item())
        if not marker:
            return loss.item(), None
        return loss.item(), (self._NEVER - marker // 4, self._KINDS[marker % 4])


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float, dims: ParallelDims) -> torch.Tensor:
    """Clip by the norm over all parameters of the model, whichever ranks hold them."""
    # DTensors of different meshes (experts under expert parallelism) do not mix in one norm.
    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = [torch.zeros((), device=params[0].device)] if not by_mesh else []  # a stage with nothing to train
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # partial norms reduced
    norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    if dims.pp > 1:  # each stage holds different parameters
        squared = norm**2
        dist.all_reduce(squared, group=dims.mesh["pp"].get_group())
        norm = squared.sqrt()
    if max_norm > 0:
        for group in by_mesh.values():  # scales each parameter's .grad: it takes parameters, not gradients
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm

"""Expert parallelism: each rank of an EP group holds E / ep of a MoE layer's routed experts, and
tokens travel to their expert's rank and back by all-to-all with uneven splits.

It wraps ``GroupedExperts`` at its seam, ``forward(tokens sorted by expert, count per expert)``:
before it, each rank sends every other rank the tokens of that rank's experts; the experts run on
what arrived; after it, the outputs go back to where their tokens came from, in the order they
left, so the MoE layer combines them exactly as without EP.

Gradients: an expert's weight gradient on its rank sums the contributions of the tokens of all ep
ranks, each already scaled by its own rank's mean loss. Dense gradients are averaged over the
dp_replicate x dp_shard x cp ranks by FSDP; expert gradients are reduced only over the ranks that
hold the same experts (replicas x efsdp), so their FSDP divides by the full data-parallel count
instead (``expert_gradient_divide_factor``), not by its own smaller mesh.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None = None) -> None:
    """Split the routed experts of every MoE block of ``model`` over ``ep_mesh``, and replicate
    them over ``tp_mesh`` (tensor parallel runs each MoE layer whole on every TP rank), on the
    meta device too: weights are drawn later, per rank, by weight_init.

    ``ep_mesh`` and ``tp_mesh`` are 1-D meshes of one root (ParallelDims.expert_mesh), either None.
    """
    meshes = [m for m in (ep_mesh, tp_mesh) if m is not None]
    mesh = meshes[0] if len(meshes) == 1 else DeviceMesh._concatenate(meshes)
    placements = [Shard(0)] * (ep_mesh is not None) + [Replicate()] * (tp_mesh is not None)

    def place(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, placements)))

    for block in model.layers.values():
        moe = getattr(block, "moe", None)
        if moe is None:
            continue
        if ep_mesh is None:
            distribute_module(moe.experts, mesh, place)
        else:
            distribute_module(
                moe.experts, mesh, place,
                lambda module, inputs, mesh: _dispatch(module, inputs, ep_mesh),
                lambda module, output, mesh: _combine(module, output, ep_mesh),
            )


_balanced_routing = False


@contextlib.contextmanager
def balanced_routing():
    """Dispatch as if every expert received the same number of tokens, without reading the routing
    (memory estimation runs on fake tensors, which have shapes but no values)."""
    global _balanced_routing
    _balanced_routing = True
    try:
        yield
    finally:
        _balanced_routing = False


def expert_gradient_divide_factor(dp_replicate: int, dp_shard: int, cp: int) -> int:
    """What FSDP divides the experts' reduced gradients by: every rank that saw different tokens."""
    return dp_replicate * dp_shard * cp


def _dispatch(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (M, dim) sorted by global expert, counts (E,)) -> (the tokens for this rank's experts,
    sorted by local expert, then source rank, then their order there; their counts (E / ep,))."""
    tokens, counts = inputs
    group = mesh.get_group()
    ep = mesh.size()
    # received[s * E_local + e]: tokens that rank s routes to this rank's e-th expert
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    received = received.view(ep, -1)  # (source rank, local expert)
    if _balanced_routing:  # no values to read: every rank sends every rank the same share
        send_splits = recv_splits = [len(part) for part in torch.arange(tokens.shape[0]).tensor_split(ep)]
        arrived = all_to_all_single_autograd(tokens, recv_splits, send_splits, group)
        order = torch.arange(arrived.shape[0], device=tokens.device)
    else:
        send_splits = counts.view(ep, -1).sum(dim=1).tolist()  # one host sync: the splits are data
        recv_splits = received.sum(dim=1).tolist()
        arrived = all_to_all_single_autograd(tokens, recv_splits, send_splits, group)  # (source, expert, token)
        local_experts = torch.arange(received.shape[1], device=counts.device).repeat(ep)
        expert_of_row = torch.repeat_interleave(local_experts, received.reshape(-1))
        order = torch.argsort(expert_of_row, stable=True)  # (expert, source, token)
    module._ep_return = (order, send_splits, recv_splits)
    return arrived[order], received.sum(dim=0)


def _combine(module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The experts' outputs back to the ranks and the order their tokens came from."""
    order, send_splits, recv_splits = module._ep_return
    del module._ep_return
    by_source = torch.empty_like(output).index_copy_(0, order, output)  # a permutation
    return all_to_all_single_autograd(by_source, send_splits, recv_splits, mesh.get_group())

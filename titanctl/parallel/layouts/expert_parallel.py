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
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

from titanctl import _torch_compat

_ALL_TO_ALL_AUTOGRAD = _torch_compat.EP_ALL_TO_ALL_AUTOGRAD


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> None:
    """Place the routed experts of every MoE block of ``model`` on ``mesh`` (ParallelDims.expert_mesh
    sliced to "ep", "tp" or ("ep", "tp")): split over "ep" (tokens then travel by all-to-all), and
    replicated over "tp" (tensor parallel runs each MoE layer whole on every TP rank). On the meta
    device too: weights are drawn later, per rank, by weight_init."""
    names = mesh.mesh_dim_names
    placements = [Shard(0) if name == "ep" else Replicate() for name in names]
    ep_mesh = mesh["ep"] if "ep" in names else None

    def place(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, placements)))

    for block in model.layers.values():
        moe = getattr(block, "moe", None)
        if moe is None:
            continue
        if ep_mesh is None:
            distribute_module(moe.experts, mesh, place)
            continue
        distribute_module(moe.experts, mesh, place, *_token_exchange(ep_mesh))


def _token_exchange(ep_mesh: DeviceMesh):
    """One MoE layer's (input_fn, output_fn) for distribute_module, sharing how its tokens left
    until their outputs go back."""
    route: dict = {}

    def dispatch(module, inputs, mesh):
        return _dispatch(inputs, ep_mesh, route)

    def combine(module, output, mesh):
        return _combine(output, ep_mesh, route)

    return dispatch, combine


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


def _dispatch(inputs: tuple, mesh: DeviceMesh, route: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (M, dim) sorted by global expert, counts (E,)) -> (the tokens for this rank's experts,
    sorted by local expert, then source rank, then their order there; their counts (E / ep,))."""
    tokens, counts = inputs
    group = mesh.get_group()
    ep = mesh.size()
    all_to_all = _ALL_TO_ALL_AUTOGRAD.get()
    # received[s * E_local + e]: tokens that rank s routes to this rank's e-th expert
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    received = received.view(ep, -1)  # (source rank, local expert)
    if _balanced_routing:  # no values to read: every rank sends every rank the same share
        send_splits = recv_splits = [len(part) for part in torch.arange(tokens.shape[0]).tensor_split(ep)]
        arrived = all_to_all(tokens, recv_splits, send_splits, group)
        order = torch.arange(arrived.shape[0], device=tokens.device)
    else:
        send_splits = counts.view(ep, -1).sum(dim=1).tolist()  # one host sync: the splits are data
        recv_splits = received.sum(dim=1).tolist()
        arrived = all_to_all(tokens, recv_splits, send_splits, group)  # (source, expert, token)
        local_experts = torch.arange(received.shape[1], device=counts.device).repeat(ep)
        expert_of_row = torch.repeat_interleave(local_experts, received.reshape(-1))
        order = torch.argsort(expert_of_row, stable=True)  # (expert, source, token)
    route["back"] = (order, send_splits, recv_splits)
    return arrived[order], received.sum(dim=0)


def _combine(output: torch.Tensor, mesh: DeviceMesh, route: dict) -> torch.Tensor:
    """The experts' outputs back to the ranks and the order their tokens came from."""
    order, send_splits, recv_splits = route.pop("back")
    by_source = torch.empty_like(output).index_copy_(0, order, output)  # a permutation
    return _ALL_TO_ALL_AUTOGRAD.get()(by_source, send_splits, recv_splits, mesh.get_group())

"""Tensor parallel for generation: plain local tensors and one collective per sharded pair of linears.

Training shards with DTensor (``parallel/tensor_parallel.py``), whose Python dispatch costs more
than a decoded token's matmuls on a small model. Generation needs only the Megatron pattern, so
here each rank keeps plain tensors: ``wq/wk/wv`` and ``w1/w3`` hold this rank's output rows (its
heads, its hidden units), ``wo`` and ``w2`` the matching input columns, and a forward hook sums
their partial outputs over the ranks (one collective each). The output layer holds this rank's vocabulary rows
and a hook gathers the whole vocabulary, so every rank sees the same logits and picks the same
token. The embedding, the norms and the RoPE table are replicated: an embedding lookup reads one
row per token, and sharding it would add a collective per token.

Two steps, around loading:

1. :func:`shard_weights` (on the meta model, before ``to_empty``) makes each sharded weight a
   DTensor, so the checkpoint readers fill only this rank's slice (DCP reads only its shards);
2. :func:`localize` (after loading) swaps every DTensor for its local tensor and installs the hooks.

The model never learns it is sharded: its projections reshape with ``-1`` heads and its KV cache
takes its head count from ``wk``. On CPU, ranks of one host exchange through shared memory
(``shm_exchange``, an op ``torch.compile`` calls as is, even from Inductor's C++ wrapper); otherwise
collectives are plain ``torch.distributed`` calls, which ``torch.compile`` traces into the step.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from titanctl.inference import shm_exchange
from titanctl.inference.shm_exchange import SharedMemoryExchange
from titanctl.models.registry import spec_of
from titanctl.parallel.layouts.tensor_parallel import head_params, submodule_or_none


def block_shards(model: nn.Module) -> dict[str, int]:
    """Block linear -> the weight dim (out = 0, in = 1) a rank holds a slice of: the training TP
    plan's column-wise linears split their outputs, its row-wise ones their inputs."""
    plan = spec_of(model.args).tp_plan.block(model.args)
    return {
        name: 0 if isinstance(style, ColwiseParallel) else 1
        for name, style in plan.items()
        if isinstance(style, (ColwiseParallel, RowwiseParallel))
    }


def sharded_linears(model: nn.Module, tp: int) -> dict[str, tuple[nn.Linear, int]]:
    """Every linear that tensor parallel splits, by name, with the dim it splits.

    The output layer is split by vocabulary rows when the vocabulary divides evenly (its logits
    are gathered with equal-sized pieces) and it is not the embedding table too (tied), which
    every rank needs whole; otherwise it stays whole on every rank.
    """
    found = {}
    shards = block_shards(model)
    for layer_id, block in model.layers.items():
        for name, dim in shards.items():
            # A Mixture-of-Experts block has no dense FFN: its router and experts stay whole on every
            # rank, which all compute them on the same (replicated) hidden states.
            module = submodule_or_none(block, name)
            if module is not None:
                found[f"layers.{layer_id}.{name}"] = (module, dim)
    if model.output is not None and model.output.out_features % tp == 0 and not model.args.tie_embeddings:
        found["output"] = (model.output, 0)
    return found


# Models whose forward now holds collectives -> how their ranks exchange.
_LOCALIZED: weakref.WeakKeyDictionary[nn.Module, RankGather] = weakref.WeakKeyDictionary()


def sharded_parameters(model: nn.Module, tp: int) -> dict[str, tuple[nn.Module, str, int]]:
    """Every parameter that tensor parallel splits: name -> (its module, its attribute, the dim split).
    A column-wise linear's bias is split with its rows; a row-wise one's stays whole (added once, after
    the sum over the ranks); the plan's per-head parameters (attention sinks) are split with the query heads."""
    found = {}
    for name, (linear, dim) in sharded_linears(model, tp).items():
        found[f"{name}.weight"] = (linear, "weight", dim)
        if dim == 0 and linear.bias is not None:
            found[f"{name}.bias"] = (linear, "bias", 0)
    plan = spec_of(model.args).tp_plan
    for layer_id, block in model.layers.items():
        for name, owner, attr in head_params(block, plan):
            found[f"layers.{layer_id}.{name}"] = (owner, attr, 0)
    return found


def shard_weights(model: nn.Module, mesh: DeviceMesh) -> None:
    """Make each split weight a DTensor sharded over ``mesh`` (1-D), for a checkpoint reader to fill."""
    for module, attr, dim in sharded_parameters(model, mesh.size()).values():
        tensor = distribute_tensor(getattr(module, attr).detach(), mesh, [Shard(dim)], src_data_rank=None)
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))


def localize(model: nn.Module, mesh: DeviceMesh) -> None:
    """Swap the DTensor weights for their local tensors and add the collectives as forward hooks.

    On CPU the ranks exchange through a shared memory segment when they share a host
    (``shm_exchange``); otherwise, and for tensors larger than its slots, through the process group.
    """
    group = mesh.get_group()
    gather = RankGather(group, mesh.size(), shm_exchange.create(group) if mesh.device_type == "cpu" else None)
    for name, (module, attr, _dim) in sharded_parameters(model, gather.tp).items():
        tensor = getattr(module, attr)
        if not isinstance(tensor, DTensor):
            raise TypeError(f"{name} is not sharded: call shard_weights before loading")
        setattr(module, attr, nn.Parameter(tensor.to_local(), requires_grad=False))
    for name, (linear, dim) in sharded_linears(model, gather.tp).items():
        if name == "output":
            linear.register_forward_hook(_GatherLastDim(gather))
        elif dim == 1:  # row-wise: each rank computed a partial sum of the whole output
            # Its bias (whole on every rank) joins once, after the sum, not once per rank.
            bias, linear.bias = linear.bias, None
            linear.register_forward_hook(_SumOverRanks(gather, bias))
    _LOCALIZED[model] = gather


def rank_gather(model: nn.Module) -> RankGather | None:
    """How ``model``'s ranks exchange, after :func:`localize` (None before, or without TP)."""
    return _LOCALIZED.get(model)


def decode_uses_process_group(model: nn.Module) -> bool:
    """Whether a decoded token of ``model`` (after :func:`localize`) calls the process group's
    collectives, rather than none or only the shared memory exchange's op."""
    gather = rank_gather(model)
    if gather is None:
        return False
    if gather.exchange is None:
        return True
    largest = max(model.args.dim, model.output.out_features if model.output is not None else 0)
    return not gather.exchange.fits(largest * next(model.parameters()).element_size())


class RankGather:
    """Every rank's tensor, in rank order: through shared memory where it fits, else the process group."""

    def __init__(self, group, tp: int, exchange: SharedMemoryExchange | None):
        self.group, self.tp, self.exchange = group, tp, exchange

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """(tp, *x.shape): every rank's x, in rank order."""
        if self.exchange is not None and self.exchange.fits(x.numel() * x.element_size()):
            return shm_exchange.shm_all_gather(x, self.exchange.key)
        pieces = x.new_empty(self.tp * x.shape[0], *x.shape[1:])
        dist.all_gather_single(pieces, x.contiguous(), group=self.group)
        return pieces.unflatten(0, (self.tp, x.shape[0]))


class _SumOverRanks:
    """Each rank's partial sum (B, T, dim) -> their total, identical on every rank.

    An all-gather and a local sum rather than an all-reduce: with two ranks the all-gather is one
    exchange where gloo's all-reduce makes two, and the latency of each exchange, not the bytes,
    is what a decoded token waits for.
    """

    def __init__(self, gather: RankGather, bias: torch.Tensor | None = None):
        self.gather, self.bias = gather, bias

    def __call__(self, module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
        total = self.gather(out).sum(0)
        return total if self.bias is None else total + self.bias


class _GatherLastDim:
    """(B, T, V / tp) on each rank -> (B, T, V) in rank order on every rank."""

    def __init__(self, gather: RankGather):
        self.gather = gather

    def __call__(self, module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
        return self.gather(out).permute(1, 2, 0, 3).flatten(2)  # (tp, B, T, V / tp) -> (B, T, V)

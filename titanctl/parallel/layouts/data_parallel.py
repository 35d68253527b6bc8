"""FSDP2 / HSDP (fully_shard on a 1-D or 2-D mesh) and DDP (replicate)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titanctl import _torch_compat


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str,
    pipelined: bool,
    experts_mesh: DeviceMesh | None = None,
    experts_divide_factor: int = 1,
) -> None:
    """Shard each block, then the rest (embeddings, norm, output) at the root.

    ``dp_mesh`` is 1-D for FSDP and 2-D (replicate, shard) for HSDP. ``experts_mesh``: under expert
    parallelism, the (smaller) mesh the routed experts are sharded over, each MoE block's experts
    their own FSDP unit whose gradients are divided by ``experts_divide_factor``.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    reshards = reshard_after_forward_plan(model, reshard_after_forward, pipelined)
    for block in model.layers.values():
        reshard = reshards[block]
        moe = getattr(block, "moe", None)
        if experts_mesh is not None and moe is not None:
            fully_shard(moe.experts, mesh=experts_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
            moe.experts.set_gradient_divide_factor(experts_divide_factor)
            if experts_mesh.size(experts_mesh.ndim - 1) > 1:
                # Sum, then divide: a divide factor other than the mesh size is otherwise a
                # PREMUL_SUM reduce-scatter, which gloo lacks. (Not with a shard group of one:
                # torch 2.13 then divides while copying, and would divide again after.)
                moe.experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshards[model])


def reshard_after_forward_plan(model: nn.Module, mode: str, pipelined: bool) -> dict[nn.Module, bool]:
    """Whether each module that ``apply_fsdp`` shards (every block, its routed experts with it, and the
    root) frees its gathered parameters after forward, for parallelism.fsdp_reshard_after_forward ``mode``."""
    blocks = list(model.layers.values())
    plan: dict[nn.Module, bool] = {}
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again right away by backward.
        plan[block] = _reshard(mode, default=not pipelined and index < len(blocks) - 1)
        if getattr(block, "moe", None) is not None:
            plan[block.moe.experts] = plan[block]
    plan[model] = _reshard(mode, default=not pipelined)
    return plan


def _reshard(mode: str, default: bool) -> bool:
    """"always" and "never" mean exactly that for every module; "default" keeps a module's
    parameters gathered where that saves an all-gather. Pipelining runs several microbatches'
    forwards before their backwards, so it keeps them gathered everywhere."""
    return {"always": True, "never": False}.get(mode, default)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, find_unused: bool = False) -> None:
    """``find_unused``: some parameters may get no gradient in a step (``ModelSpec.parameters_may_go_unused``);
    DDP looks for them after each backward and leaves theirs None."""
    # The composable replicate keeps parameter names unchanged (no "module." prefix).
    # No buffer broadcast before each forward: rank 0's would overwrite each rank's own MoE token
    # counts (the other buffers are equal on every rank already).
    _torch_compat.REPLICATE.get()(model, device_mesh=dp_mesh, bucket_cap_mb=100, broadcast_buffers=False,
                                  find_unused_parameters=find_unused)


def apply_compile(model: nn.Module) -> None:
    """Compile each block, and the final norm where this part has it, in place: blocks are
    identical, so one graph serves them all, and parameter names stay canonical (no _orig_mod).
    (The loss is compiled by ``titanctl.train.loss.build_loss_fn``.)"""
    for block in model.layers.values():
        block.compile(fullgraph=getattr(block, "moe", None) is None)  # MoE layers run eagerly between graphs
    if getattr(model, "norm", None) is not None:
        model.norm.compile(fullgraph=True)

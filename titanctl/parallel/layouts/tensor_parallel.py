"""Tensor parallel (+ sequence parallel, loss parallel, async TP) from the model's plan."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from titanctl import _torch_compat
from titanctl.errors import ParallelError
from titanctl.models.common.args import ModelArgs
from titanctl.models.registry import spec_of
from titanctl.models.spec import TPPlan
from titanctl.parallel.converters.float8 import float8_tp_styles, is_float8_linear, sends_float8
from titanctl.parallel.converters.lora import tp_style as lora_tp_style


def check_tp(args: ModelArgs, tp: int, seq_len: int) -> None:
    """Fail before any collective if the model cannot be split tp ways (what its plan splits, and the sequence)."""
    split_sizes = spec_of(args).tp_plan.split_sizes or decoder_split_sizes
    for what, size in (*split_sizes(args), ("training.seq_len (sequence parallel)", seq_len)):
        if size % tp:
            raise ParallelError(f"{what} = {size} is not divisible by tensor_parallel_degree = {tp}")


def decoder_split_sizes(args: ModelArgs) -> list[tuple[str, int]]:
    """What the shared decoder's plan splits: heads, the FFN's hidden units, Gated DeltaNet's key-head groups
    (each with its value heads)."""
    sizes = [("model n_heads", args.n_heads), ("model n_kv_heads", args.kv_heads),
             ("ffn hidden dim", args.ffn_hidden_dim)]
    if args.linear_attention is not None:
        sizes.append(("model linear_attention.num_key_heads", args.linear_attention.num_key_heads))
    return sizes


def apply_tp(
    model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool, async_tp: bool, compiled: bool, float8: bool = False,
    sequence_parallel: bool = True,
) -> None:
    """Shard ``model`` (a whole model or a pipeline stage: absent parts are skipped).

    ``sequence_parallel=False``: the plan's variant whose activations stay whole on every rank between
    blocks (``TPPlan.sequence_parallel_optional``; the logits gathered whole, so no loss parallel).

    ``float8``: the model's float8 linears get torchao's float8 styles (see tp_plan.block_plan),
    which all-gather activations in float8; on gloo, which has no float8 dtypes, they keep the
    plain styles (float8 matmuls, high-precision communication).
    """
    plan = spec_of(model.args).tp_plan
    variant = {}
    if not sequence_parallel:
        if not plan.sequence_parallel_optional:
            raise ParallelError(f"{model.args.family}'s tensor-parallel plan always shards the sequence: it has no "
                                "plan for a decode step of one token")
        variant = {"sequence_parallel": False}
    # A LoRA linear's adapter is split with it (lora.tp_style).
    root = {name: lora_tp_style(getattr(model, name), style)
            for name, style in plan.root(loss_parallel, **variant).items() if getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, root)
    if extra := plan.extra(model):
        parallelize_module(model, tp_mesh, extra)
    if compiled:
        # torch 2.13: a compiled block whose input is the view that DTensor.to_local() returns (the
        # embedding's local output, or a prediction depth's projection) gives that input no gradient,
        # and the backward fails in its redistribute. A copy (B x T/tp x dim) makes it a plain tensor.
        for name in plan.block_inputs(model):
            if (module := submodule_or_none(model, name)) is not None:
                module.register_forward_hook(lambda module, inputs, output: output.clone())
    styles = None
    if float8:
        if sends_float8(tp_mesh):
            styles = float8_tp_styles()
    for block in model.layers.values():
        names = [name for name, m in block.named_modules() if float8 and is_float8_linear(m)]
        block_plan = plan.block(model.args, styles, names, **variant)
        present = {name: lora_tp_style(module, style) for name, style in block_plan.items()
                   if (module := submodule_or_none(block, name)) is not None}
        parallelize_module(block, tp_mesh, present)
        for name in plan.replicated:
            if (module := submodule_or_none(block, name)) is not None:
                _replicate(module, tp_mesh)
        for name in plan.summed_gradient:
            if (module := submodule_or_none(block, name)) is not None:
                _sum_gradient_over_ranks(module, tp_mesh)
        for _, owner, attr in head_params(block, plan):  # the module reads its own heads' values
            setattr(owner, attr, nn.Parameter(distribute_tensor(getattr(owner, attr), tp_mesh, [Shard(0)])))
        for _, owner, attr in head_params(block, plan, plan.replicated_params):
            setattr(owner, attr, nn.Parameter(distribute_tensor(getattr(owner, attr), tp_mesh, [Replicate()])))
        for name in ("moe.router.gate", "moe.shared_experts", "moe.shared_gate"):  # the shared MoE's
            if (module := submodule_or_none(block, name)) is not None:
                _replicate(module, tp_mesh)
    model.tie_weights()  # distributing each module gave the output layer a Parameter of its own
    if async_tp:
        enable_async_tp(tp_mesh, compiled)


def _replicate(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """``module`` computed whole on every TP rank from local inputs that are equal there: its
    parameters become replicated DTensors (so that they sit beside the split ones in one optimizer
    and one FSDP unit); its inputs and outputs stay local tensors."""

    def replicate_parameters(name: str, submodule: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(submodule.named_parameters(recurse=False)):
            submodule.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

    distribute_module(
        module, tp_mesh, replicate_parameters,
        lambda module, inputs, mesh: tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs),
        lambda module, output, mesh: output.to_local(),
    )


def _sum_gradient_over_ranks(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """``module``'s first input, equal on every rank, feeds only this rank's heads: its forward is
    unchanged and in backward its gradient becomes the sum of every rank's (an all-reduce; Megatron's
    "copy to the tensor-parallel region"). Marked as a partial sum, it is reduced on its way back to
    the replicated tensor it came from."""

    def whole_forward_summed_backward(module, inputs, mesh):
        first = DTensor.from_local(inputs[0], mesh, [Replicate()], run_check=False)
        return (first.to_local(grad_placements=[Partial()]), *inputs[1:])

    distribute_module(module, tp_mesh, input_fn=whole_forward_summed_backward)


def head_params(block: nn.Module, plan: TPPlan, names: tuple[str, ...] | None = None
                ) -> list[tuple[str, nn.Module, str]]:
    """(name, owning module, attribute) of each of the plan's ``head_params`` (or of ``names``) that ``block``
    has."""
    found = []
    for name in plan.head_params if names is None else names:
        owner_name, _, attr = name.rpartition(".")
        owner = submodule_or_none(block, owner_name)
        if owner is not None and getattr(owner, attr, None) is not None:
            found.append((name, owner, attr))
    return found


def submodule_or_none(module: nn.Module, name: str) -> nn.Module | None:
    """``module``'s submodule ``name`` (dotted), or None where a part is absent (a dense block has no
    moe, an MoE block no feed_forward)."""
    for part in name.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def check_async_tp(device_type: str, compiled: bool) -> None:
    """What parallelism.enable_async_tensor_parallel needs of the run."""
    if device_type != "cuda":
        raise ParallelError(
            "parallelism.enable_async_tensor_parallel needs CUDA (symmetric memory); this run is on "
            f"{device_type}: set it to false"
        )
    if not compiled:
        raise ParallelError("parallelism.enable_async_tensor_parallel needs compile.enable = true")


def enable_async_tp(tp_mesh: DeviceMesh, compiled: bool) -> None:
    """Overlap TP's all-gathers/reduce-scatters with matmuls (inductor's micro-pipeline pass)."""
    check_async_tp(tp_mesh.device_type, compiled)
    _torch_compat.enable_inductor_micro_pipeline_tp()
    _torch_compat.ENABLE_SYMM_MEM_FOR_GROUP.get()(tp_mesh.get_group().group_name)

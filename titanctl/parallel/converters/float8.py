"""Float8 training with torchao: linear layers that multiply in float8 with dynamic scales
(``float8.recipe_name``: tensorwise, e4m3 forward and e5m2 for gradients; or rowwise, e4m3 with one
power-of-2 scale per row), keeping their weights in high precision.

The swap is a model converter: it runs on the whole model on the meta device, before the model
is split into pipeline stages and before TP, activation checkpointing, compile and FSDP, which
then wrap the float8 linears as they would plain ones (TP with torchao's float8 styles, so
activations are cast to float8 before they are all-gathered). A float8 linear keeps its
``weight`` parameter under the same name and dtype, so checkpoints hold plain weights under
canonical names.

torchao is imported only here and only when float8 is on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titanctl import _torch_compat
from titanctl.config.job_config import Float8 as Float8Config
from titanctl.config.job_config import JobConfig
from titanctl.errors import ConfigError, ParallelError
from titanctl.models.common.tp_plan import LinearStyles, sharded_linear_dims
from titanctl.models.registry import spec_of

# torch._scaled_mm needs both dims of each float8 operand to be multiples of 16.
DIM_MULTIPLE = 16


class _DropMessages(logging.Filter):
    def __init__(self, needles: tuple[str, ...]):
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(needle in message for needle in self.needles)


@contextlib.contextmanager
def _without_log_messages(logger_name: str, *needles: str) -> Iterator[None]:
    logger = logging.getLogger(logger_name)
    dropper = _DropMessages(needles)
    logger.addFilter(dropper)
    try:
        yield
    finally:
        logger.removeFilter(dropper)


@functools.cache
def torchao_float8():
    """``torchao.float8`` and its TP styles, imported without torchao's import-time noise.

    On a CPU-only torch, ``import torchao`` logs "Failed to load .../_C_mxfp8...so" for each of its
    CUDA extension libraries (unused by float8 training: its kernels are torch ops), and torch's
    pytree module logs that registering torchao's ``KernelPreference`` enum as a pytree constant
    is deprecated. Both are warnings about parts we do not use; only those two messages are
    dropped, and only while importing.
    """
    with (
        _without_log_messages("torchao", "Failed to load"),
        _without_log_messages(_torch_compat.PYTREE_LOGGER.path, "is an Enum subclass"),
    ):
        import torchao.float8 as f8
        import torchao.float8.float8_linear
        import torchao.float8.float8_tensor_parallel
        import torchao.float8.fsdp_utils  # noqa: F401
    return f8


def is_float8_linear(module: nn.Module) -> bool:
    return isinstance(module, torchao_float8().float8_linear.Float8Linear)


def communicates_float8(cfg: Float8Config) -> bool:
    """Whether tensor parallel may all-gather in float8: torchao's float8 TP styles cast with one
    scale per tensor, so they serve the tensorwise recipe only (rowwise keeps the plain styles)."""
    return cfg.enable_float8_linear and cfg.recipe_name == "tensorwise"


def float8_tp_styles() -> LinearStyles:
    """torchao's TP styles: they cast a linear's input to float8 before its all-gather."""
    tp = torchao_float8().float8_tensor_parallel
    return LinearStyles(
        colwise=tp.Float8ColwiseParallel,
        rowwise=tp.Float8RowwiseParallel,
        prepare_input=tp.PrepareFloat8ModuleInput,
    )


def sends_float8(mesh) -> bool:
    """Whether the mesh's backend communicates float8 tensors (gloo has no float8 dtypes)."""
    return dist.get_backend(mesh.get_group()) != "gloo"


def has_float8_hardware(device: torch.device) -> bool:
    """Float8 matmul units: NVIDIA SM 8.9+ (Ada, Hopper, Blackwell) or AMD MI300 (gfx94x)."""
    if device.type != "cuda":
        return False
    if torch.version.hip:
        return "gfx94" in torch.cuda.get_device_properties(device).gcnArchName
    return torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def _scaled_mm_runs(device_type: str) -> bool:
    """Whether torch._scaled_mm has a kernel for float8 on this device type (CPU: torch >= 2.9)."""
    a = torch.ones(16, 16, device=device_type).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16, device=device_type).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device_type)
    try:
        _torch_compat.SCALED_MM.get()(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def emulation_note(device: torch.device) -> str | None:
    """None on float8 hardware; otherwise how float8 runs here (said once on the console)."""
    if has_float8_hardware(device):
        return None
    if _scaled_mm_runs(device.type):
        how = f"torch._scaled_mm's {device.type} kernel"
    else:
        how = "torchao's emulation (dequantize, then an fp32 matmul)"
    return (
        f"float8 is emulated: {device} has no float8 matmul hardware, so the float8 casts and scaled "
        f"matmuls run through {how}; numerics are float8's, speed is not (use CUDA SM 8.9+ for that)"
    )


def check_float8(cfg: JobConfig, *, fsdp: bool) -> None:
    """Float8 settings that cannot work in this layout, refused before the model is built."""
    f8 = cfg.float8
    if not f8.enable_float8_linear:
        for key in ("enable_fsdp_float8_all_gather", "precompute_float8_dynamic_scale_for_fsdp"):
            if getattr(f8, key):
                raise ConfigError(f"float8.{key} = true needs float8.enable_float8_linear = true")
        return
    if f8.enable_fsdp_float8_all_gather and not fsdp:
        raise ParallelError(
            "float8.enable_fsdp_float8_all_gather = true needs FSDP (data_parallel_shard_degree > 1, "
            "or context parallel), and this layout has none: set it to false"
        )
    if f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise":
        raise ConfigError(
            f"float8.enable_fsdp_float8_all_gather = true needs float8.recipe_name = 'tensorwise' (torchao "
            f"all-gathers tensorwise-scaled weights only), not {f8.recipe_name!r}"
        )
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        raise ConfigError(
            "float8.precompute_float8_dynamic_scale_for_fsdp = true needs "
            "float8.enable_fsdp_float8_all_gather = true (it precomputes the scales of those all-gathers)"
        )


def _matches(fqn: str, pattern: str) -> bool:
    """``pattern`` is the whole name or a run of whole dotted parts of it."""
    return f".{pattern}." in f".{fqn}."


@dataclass
class Float8Conversion:
    converted: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # linear name -> why it stays high precision
    notes: list[str] = field(default_factory=list)  # how float8 composes with this layout

    def describe(self) -> str:
        """What was converted and what was kept in high precision, and why (one line), then the notes."""
        text = f"float8: {len(self.converted)} linear layers in float8"
        if self.kept:
            text += "; kept in high precision: " + ", ".join(f"{name} ({why})" for name, why in self.kept.items())
        return "\n".join([text, *self.notes])


def plan_conversion(model: nn.Module, cfg: Float8Config, tp: int) -> Float8Conversion:
    """Which linears of ``model`` (a whole model, canonical names) become float8, and why not."""
    plan = Float8Conversion()
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    tp_plan = spec_of(model.args).tp_plan
    for pattern in cfg.filter_fqns:
        if not any(_matches(name, pattern) for name in linears):
            raise ConfigError(
                f"float8.filter_fqns entry {pattern!r} names no linear layer; linears are named like "
                "output, layers.0.attention.wq, or use a part such as attention.wk or feed_forward"
            )
    for name, linear in linears.items():
        out_dim, in_dim = linear.weight.shape
        out_split, in_split = sharded_linear_dims(name, tp, tp_plan, model.args)
        local = (out_dim // out_split, in_dim // in_split)
        if any(_matches(name, pattern) for pattern in cfg.filter_fqns):
            plan.kept[name] = "float8.filter_fqns"
        elif any(d % DIM_MULTIPLE for d in local):
            per_shard = " per tensor-parallel shard" if tp > 1 else ""
            plan.kept[name] = f"dims {local[0]}x{local[1]}{per_shard} are not multiples of {DIM_MULTIPLE}"
        else:
            plan.converted.append(name)
    return plan


def convert_to_float8(model: nn.Module, cfg: Float8Config, *, tp: int, device: torch.device) -> Float8Conversion:
    """Swap the linears of ``model`` (on the meta device, before any parallelism) for float8 ones."""
    if device.type not in ("cuda", "cpu"):
        raise ParallelError(f"float8.enable_float8_linear runs on CUDA or CPU, not on {device.type}: set it to false")
    plan = plan_conversion(model, cfg, tp)
    f8 = torchao_float8()
    config = dataclasses.replace(
        f8.Float8LinearConfig.from_recipe_name(cfg.recipe_name),
        enable_fsdp_float8_all_gather=cfg.enable_fsdp_float8_all_gather,
        # Without float8 units and without a _scaled_mm kernel, torchao dequantizes and multiplies.
        emulate=not has_float8_hardware(device) and not _scaled_mm_runs(device.type),
    )
    chosen = set(plan.converted)
    f8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _, name: name in chosen)
    if cfg.enable_fsdp_float8_all_gather:
        for name in chosen:
            model.get_submodule(name).register_state_dict_post_hook(_plain_weight_in_state_dict)
    return plan


def _plain_weight_in_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """For float8 FSDP all-gathers torchao wraps the weight in a tensor subclass that casts itself
    to float8 when FSDP gathers it. State dicts (checkpoints) get the plain tensor inside, sharing
    its storage: a checkpoint holds plain weights that any reader can load, and loading a
    checkpoint in place still writes into the parameter."""
    key = prefix + "weight"
    tensor = state_dict.get(key)
    wrapper = torchao_float8().fsdp_utils.WeightWithDynamicFloat8CastTensor
    local = _torch_compat.dtensor_local_tensor(tensor) if isinstance(tensor, DTensor) else None
    if isinstance(local, wrapper):
        state_dict[key] = DTensor.from_local(
            _torch_compat.float8_weight_inner(local).detach(), tensor.device_mesh, tensor.placements,
            run_check=False, shape=tensor.shape, stride=tensor.stride(),
        )
    elif isinstance(tensor, wrapper):
        state_dict[key] = _torch_compat.float8_weight_inner(tensor).detach()


def precompute_float8_scales(model_parts: list[nn.Module]) -> None:
    """After the optimizer step: every FSDP float8 weight's scale, from one all-reduce of their amaxes."""
    for part in model_parts:
        torchao_float8().precompute_float8_dynamic_scale_for_fsdp(part)

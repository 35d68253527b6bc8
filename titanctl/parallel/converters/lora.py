"""LoRA: low-rank adapters trained on a frozen base model (Hu et al., 2021), as a model converter.

A targeted linear ``W`` (out x in) computes ``W x + (alpha / rank) B A dropout(x)`` with ``A`` (rank x in)
and ``B`` (out x rank) the only trained parameters: ``A`` is drawn as peft draws it (uniform within
1/sqrt(in)), ``B`` starts at zero, so the first step's model is the base. A routed-expert stack
``w`` [E, out, in] gets a stack of adapters, one per expert: ``w_lora_a`` [E, rank, in] and
``w_lora_b`` [E, out, rank]. Every other parameter is frozen (``requires_grad = False``): it gets
no gradient, the optimizer never sees it, and checkpoints leave it out (``titanctl.checkpoint``).

Like float8's, the conversion runs on the whole model on the meta device, before pipeline splitting,
TP, activation checkpointing, compile and FSDP, so adapters have canonical names
(``layers.0.attention.wq.lora_a``, ``layers.1.moe.experts.w1_lora_b``) that survive every layout.
Under TP an adapter is split as its linear is: a column-wise linear's ``B`` by rows (its output), a
row-wise linear's ``A`` by columns (its input); the other factor is replicated, and its gradient,
made of every rank's partial sums, is summed over the TP ranks (``_whole``). Under EP the adapter
stacks are split over experts with their weights (``apply_ep`` places every parameter of the experts).
"""

from __future__ import annotations

import copy
import functools
import math
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from titanctl.config.job_config import JobConfig
from titanctl.config.job_config import LoRA as LoRAConfig
from titanctl.config.user_regex import UserRegex
from titanctl.errors import ConfigError
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.init import ParamInit
from titanctl.models.common.moe import GroupedExperts, autocast_operands

EXPERT_WEIGHTS = ("w1", "w2", "w3")
EXPERT_RANK_MULTIPLE = 8  # torch._grouped_mm's operands need strides of 16 bytes
_ADAPTER = re.compile(r"(?:\.lora_[ab]|(?:^|\.)w[123]_lora_[ab])$")


def is_adapter(name: str) -> bool:
    """Whether a (canonical) parameter name is an adapter's."""
    return _ADAPTER.search(name) is not None


def adapter_names(target: str, kind: str) -> tuple[str, str]:
    """The (A, B) parameter names of a target: ``{linear}.lora_a``, or ``{experts}.w1_lora_a`` for a stack."""
    if kind == "linear":
        return f"{target}.lora_a", f"{target}.lora_b"
    module, _, weight = target.rpartition(".")
    return f"{module}.{weight}_lora_a", f"{module}.{weight}_lora_b"


def _whole(param: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor parameter whose gradient arrives as every rank's partial sum (a factor
    next to a split one) gets the sum: the same tensor, whose backward all-reduces the gradient."""
    if isinstance(param, DTensor) and all(p.is_replicate() for p in param.placements):
        return DTensor.from_local(param.to_local(), param.device_mesh, param.placements, run_check=False)
    return param


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with an adapter: ``lora_a`` (rank x in), ``lora_b`` (out x rank)."""

    lora_scale: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        low = F.linear(h, _whole(self.lora_a))  # (..., rank)
        return base + F.linear(low, _whole(self.lora_b)) * self.lora_scale


class LoRAGroupedExperts(GroupedExperts):
    """Routed experts with per-expert adapters on the stacks named in ``lora_targets``."""

    lora_targets: tuple[str, ...]
    lora_scale: float
    lora_dropout: float

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """As ``GroupedExperts.forward`` (tokens sorted by expert, ``counts`` per local expert)."""
        grouped_mm = self.grouped_mm
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)

        def project(which: str, inputs: torch.Tensor) -> torch.Tensor:
            inputs, weight = autocast_operands(inputs, _local(getattr(self, which)))
            out = grouped_mm(inputs, weight.transpose(-2, -1), offs=offsets)
            if which not in self.lora_targets:
                return out
            a, b = autocast_operands(_local(getattr(self, f"{which}_lora_a")), _local(getattr(self, f"{which}_lora_b")))
            h = F.dropout(inputs, self.lora_dropout, self.training) if self.lora_dropout else inputs
            low = grouped_mm(h, a.transpose(-2, -1), offs=offsets)  # (M, rank)
            return out + grouped_mm(low, b.transpose(-2, -1), offs=offsets) * self.lora_scale

        return project("w2", F.silu(project("w1", x)) * project("w3", x))


def candidates(model: nn.Module) -> dict[str, str]:
    """{canonical name: "linear" | "experts"} of what may get an adapter: every linear layer, and every
    routed expert stack (``layers.{i}.moe.experts.w1``)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            out[name] = "linear"
        elif isinstance(module, GroupedExperts):
            out.update({f"{name}.{w}": "experts" for w in EXPERT_WEIGHTS})
    return out


def _part_of(name: str, pattern: str) -> bool:
    """``pattern`` is the whole name or a run of whole dotted parts of it (as float8.filter_fqns)."""
    return f".{pattern}." in f".{name}."


def resolve_targets(model: nn.Module, cfg: LoRAConfig) -> dict[str, str]:
    """{target: kind} chosen by lora.target_regex, or else lora.target_modules; one-line ConfigErrors."""
    found = candidates(model)
    if cfg.target_regex:
        matched = set(UserRegex("lora.target_regex", cfg.target_regex).matching(found))
        chosen = {name: kind for name, kind in found.items() if name in matched}
        if not chosen:
            raise ConfigError(
                f"config key 'lora.target_regex' = {cfg.target_regex!r} matches no linear layer or expert stack; "
                f"they are named like {_examples(found)}"
            )
    else:
        if not cfg.target_modules:
            raise ConfigError("config key 'lora.target_modules' is empty and lora.target_regex unset: nothing to adapt")
        for pattern in cfg.target_modules:
            if not any(_part_of(name, pattern) for name in found):
                raise ConfigError(
                    f"config key 'lora.target_modules' entry {pattern!r} names no linear layer or expert stack; "
                    f"they are named like {_examples(found)}"
                )
        chosen = {name: kind for name, kind in found.items() if any(_part_of(name, p) for p in cfg.target_modules)}
    args: ModelArgs = model.args
    if args.tie_embeddings and "output" in chosen:
        raise ConfigError(
            "lora targets the output layer of a model whose output layer is its embedding (tied): an adapter "
            "would untie them; leave output out of lora.target_modules / lora.target_regex"
        )
    return chosen


def _examples(found: dict[str, str]) -> str:
    picks = [next((n for n in found if n.endswith(s)), None) for s in ("attention.wq", "feed_forward.w1", "experts.w1")]
    return ", ".join(n for n in [*picks, "output"] if n is not None and (n in found))


@dataclass
class LoRAConversion:
    targets: dict[str, str]  # canonical name -> "linear" | "experts"
    rank: int
    alpha: float
    dropout: float
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # adapter parameter -> shape

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def record(self) -> dict:
        """What a checkpoint's titanctl.json records about its adapters (``lora``), less the base."""
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": dict(self.targets)}

    @property
    def trainable(self) -> int:
        return sum(math.prod(s) for s in self.shapes.values())

    def describe(self, base_params: int) -> str:
        """One line: how many modules got adapters, and the trainable share of the model."""
        stacks = sum(kind == "experts" for kind in self.targets.values())
        what = f"{len(self.targets) - stacks} linear layers" + (f" and {stacks} expert stacks" if stacks else "")
        return (f"lora: rank {self.rank}, alpha {self.alpha:g} (scale {self.scale:g}) on {what}; "
                f"{self.trainable / 1e6:.3g}M trainable parameters, {base_params / 1e6:.4g}M frozen "
                f"({100 * self.trainable / max(1, base_params):.2g}%)")


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> LoRAConversion:
    """Give ``model`` (a whole model, canonical names, on any device: the meta device in training)
    its adapters, and freeze every other parameter."""
    targets = resolve_targets(model, cfg)
    if cfg.rank % EXPERT_RANK_MULTIPLE and "experts" in targets.values():
        raise ConfigError(
            f"lora.rank = {cfg.rank} with adapters on routed experts: their grouped matmuls (torch._grouped_mm) "
            f"need the rank to be a multiple of {EXPERT_RANK_MULTIPLE} (rows of 16 bytes in bf16)"
        )
    _check_rank(model, targets, cfg.rank)
    conversion = LoRAConversion(targets, cfg.rank, cfg.alpha, cfg.dropout)
    r = cfg.rank
    stacks: dict[str, list[str]] = {}
    for name, kind in targets.items():
        if kind == "experts":
            module, _, weight = name.rpartition(".")
            stacks.setdefault(module, []).append(weight)
            continue
        linear = model.get_submodule(name)
        out_dim, in_dim = linear.weight.shape
        _add(linear, "lora_a", (r, in_dim), linear.weight)
        _add(linear, "lora_b", (out_dim, r), linear.weight)
        linear.__class__ = LoRALinear
        linear.lora_scale, linear.lora_dropout = conversion.scale, cfg.dropout
    for name, weights in stacks.items():
        experts = model.get_submodule(name)
        for w in weights:
            stack = getattr(experts, w)  # (E, out, in)
            _add(experts, f"{w}_lora_a", (stack.shape[0], r, stack.shape[2]), stack)
            _add(experts, f"{w}_lora_b", (stack.shape[0], stack.shape[1], r), stack)
        experts.__class__ = LoRAGroupedExperts
        experts.lora_targets = tuple(weights)
        experts.lora_scale, experts.lora_dropout = conversion.scale, cfg.dropout
    freeze_base(model)
    conversion.shapes = {name: tuple(p.shape) for name, p in model.named_parameters() if is_adapter(name)}
    return conversion


def _check_rank(model: nn.Module, targets: dict[str, str], rank: int) -> None:
    """A rank above min(in, out) of a target adds parameters (and memory) but no expressiveness: B A of
    such a layer already spans every matrix of its shape. Refused before any adapter is made."""
    def dims(name: str, kind: str) -> tuple[int, int]:  # (out, in)
        if kind == "experts":
            module, _, weight = name.rpartition(".")
            return tuple(getattr(model.get_submodule(module), weight).shape[1:])
        return tuple(model.get_submodule(name).weight.shape)

    name, (out_dim, in_dim) = min(((n, dims(n, k)) for n, k in targets.items()), key=lambda item: min(item[1]))
    if rank > min(out_dim, in_dim):
        raise ConfigError(
            f"config key 'lora.rank' = {rank} exceeds min(in, out) = {min(out_dim, in_dim)} of target {name} "
            f"(in {in_dim}, out {out_dim}): a higher rank adds parameters, not expressiveness; valid: 1 to "
            f"{min(out_dim, in_dim)} for these targets"
        )


def freeze_base(model: nn.Module) -> None:
    """Only adapters train. Again after TP and EP: styles that replicate a module (sequence parallel's
    norms, the router, experts) make new Parameters, which require gradients."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))


def _add(module: nn.Module, name: str, shape: tuple[int, ...], like: torch.Tensor) -> None:
    module.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=like.dtype, device=like.device)))


def adapter_init(name: str, shape: tuple[int, ...]) -> ParamInit:
    """A: uniform within 1/sqrt(in) (peft's kaiming_uniform_(a=sqrt(5)) of a linear); B: zeros."""
    if name.endswith("lora_b"):
        return ParamInit("zeros")
    return ParamInit("uniform", bound=1 / math.sqrt(shape[-1]))


def check_lora(cfg: JobConfig) -> None:
    """LoRA settings that cannot work with the rest of the recipe, refused before the model is built."""
    if not cfg.lora.enable:
        return
    if cfg.float8.enable_float8_linear:
        raise ConfigError(
            "lora.enable with float8.enable_float8_linear: adapters on float8 linears are not supported; "
            "turn one of them off"
        )


# ----------------------------------------------------------------------------- tensor parallel


def _place(module: nn.Module, mesh, placements: dict[str, object], src_data_rank) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dist_param = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist_param, requires_grad=param.requires_grad))


class _LoRAColwise(ColwiseParallel):
    """Column-wise: W and B split by output rows, A replicated."""

    def _partition_linear_fn(self, name, module, device_mesh):
        placements = {"weight": Shard(0), "bias": Shard(0), "lora_a": Replicate(), "lora_b": Shard(0)}
        _place(module, device_mesh, placements, self.src_data_rank)


class _LoRARowwise(RowwiseParallel):
    """Row-wise: W and A split by input columns, B replicated (its product adds to the partial sums)."""

    def _partition_linear_fn(self, name, module, device_mesh):
        placements = {"weight": Shard(1), "bias": Replicate(), "lora_a": Shard(1), "lora_b": Replicate()}
        _place(module, device_mesh, placements, self.src_data_rank)


def tp_style(module: nn.Module, style):
    """The style that splits ``module`` as ``style`` does, adapters included: torch's column- and
    row-wise styles split every parameter alike (colwise) or only the weight (rowwise). Other
    styles (sequence parallel, replication) treat every parameter alike, adapters too."""
    if not isinstance(module, LoRALinear):
        return style
    for plain, adapted in ((ColwiseParallel, _LoRAColwise), (RowwiseParallel, _LoRARowwise)):
        if type(style) is plain:
            out = copy.copy(style)
            out.__class__ = adapted
            return out
    return style


# ----------------------------------------------------------------------------- what a LoRA checkpoint holds


def saved_shapes(args: ModelArgs, cfg: LoRAConfig) -> dict[str, tuple[int, ...]]:
    """{canonical name: shape} of what a LoRA run's checkpoint holds: the adapters and the model's saved
    buffers (an MoE's expert bias, which balancing moves while the base is frozen)."""
    return dict(_saved_shapes(args, cfg.rank, tuple(cfg.target_modules), cfg.target_regex))


def adapter_slots(args: ModelArgs) -> dict[str, str]:
    """``candidates`` of the model ``args`` describes: what an adapter may sit on (a peft import asks)."""
    return dict(_slots(args))


@functools.lru_cache(maxsize=8)
def _slots(args: ModelArgs) -> tuple:
    from titanctl.models.registry import build_model

    with torch.device("meta"):
        return tuple(candidates(build_model(args.replace(max_seq_len=1))).items())


@functools.lru_cache(maxsize=8)
def _saved_shapes(args: ModelArgs, rank: int, modules: tuple[str, ...], regex: str) -> tuple:
    from titanctl.models.registry import build_model

    with torch.device("meta"):
        model = build_model(args.replace(max_seq_len=1))  # the RoPE table is no weight
    apply_lora(model, LoRAConfig(enable=True, rank=rank, target_modules=list(modules), target_regex=regex))
    buffers = {name for name, _ in model.named_buffers()}
    return tuple((name, tuple(t.shape)) for name, t in model.state_dict(keep_vars=True).items()
                 if is_adapter(name) or name in buffers)

"""A training run's checkpointed state, one ``Stateful`` per part.

``CheckpointManager`` hands DCP a dict of these (the model's tensors at the top level, the
others under their part names, see ``titanctl.checkpoint.trust.metadata``); DCP calls
``state_dict()`` on each before a save or a load and ``load_state_dict()`` after a load, in
the order of the part names, so no part depends on another having been loaded first.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from titanctl import _torch_compat
from titanctl.errors import CheckpointError
from titanctl.parallel.layouts.weight_init import canonical_name

# Optimizer param-group entries this run chooses itself: the kernel that suits its layout, and
# the lr, which the LR schedule sets (restored or fresh), not the optimizer's saved value.
_RUN_OWN_KEYS = ("lr", "fused", "foreach", "capturable", "differentiable")
STEP_COUNT = _torch_compat.LR_SCHEDULER_STEP_COUNT_KEY  # the scheduler's own step counter


class _PartsView(nn.Module):
    """Several pipeline stages of one rank as one module with the canonical names.

    Stages are cut from one Transformer and keep its names (``layers`` is keyed by layer id),
    so their children merge without prefixes; the modules are shared, not copied.
    """

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        layers = nn.ModuleDict()
        for part in parts:
            if next(part.parameters(recurse=False), None) is not None:
                raise ValueError("a model part holds parameters of its own; cannot merge parts")
            for name, child in part.named_children():
                if name == "layers":
                    for layer_id, block in child.items():
                        layers[layer_id] = block
                elif name in dict(self.named_children()):
                    raise ValueError(f"two model parts both hold {name!r}")
                else:
                    self.add_module(name, child)
        self.add_module("layers", layers)


class ModelState(Stateful):
    """This rank's model parts (pipeline stages) as one state dict under canonical names, under
    every layout and wrapper (FSDP, TP, compile, activation checkpointing).

    ``keep``: only the entries whose canonical name it accepts (a LoRA run saves its adapters and
    buffers, not the frozen base; it loads the base alone from the base's checkpoint)."""

    def __init__(self, parts: list[nn.Module], keep: Callable[[str], bool] | None = None) -> None:
        self.module = parts[0] if len(parts) == 1 else _PartsView(parts)
        self.keep = keep

    def state_dict(self) -> dict[str, Any]:
        state = get_model_state_dict(self.module)
        return state if self.keep is None else {k: v for k, v in state.items() if self.keep(k)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        options = None if self.keep is None else StateDictOptions(strict=False)
        set_model_state_dict(self.module, state_dict, options=options)


class OptimizerState(Stateful):
    """The optimizer's state with flattened per-parameter keys (``state.layers.0....exp_avg``), so it
    reshards across layouts. Loading keeps this run's kernel choice and lr (see _RUN_OWN_KEYS)."""

    def __init__(self, model: ModelState, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self._options = StateDictOptions(flatten_optimizer_state_dict=True)
        # Parameters the loading checkpoint holds no state for (no gradient had reached them when it was
        # saved: DeepSeek-V4's indexer without its loss): ``stateless_in``, before a load.
        self.stateless: set[str] = set()

    def stateless_in(self, entries: Iterable[str], prefix: str) -> set[str]:
        """Of this optimizer's flattened keys (``prefix`` + ``state.<param>.<name>``), those of parameters of which
        ``entries`` (a checkpoint's) holds no state at all: a load leaves them without state, as they were."""
        held = {key[len(prefix):] for key in entries if key.startswith(prefix + "state.")}
        params = {key.rsplit(".", 1)[0] for key in held}
        mine = [key for key in self.state_dict() if key.startswith("state.")]
        self.stateless = {key.rsplit(".", 1)[0][len("state."):] for key in mine
                          if key.rsplit(".", 1)[0] not in params}
        return {prefix + key for key in mine if key.rsplit(".", 1)[0][len("state."):] in self.stateless}

    def state_dict(self) -> dict[str, Any]:
        # On a fresh optimizer this first creates its state tensors, for a load to fill.
        return get_optimizer_state_dict(self.model.module, self.optimizer, options=self._options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        own = [{k: g[k] for k in _RUN_OWN_KEYS if k in g} for g in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model.module, self.optimizer, state_dict, options=self._options)
        for group, kept in zip(self.optimizer.param_groups, own):
            group.update(kept)
        for name, param in self.model.module.named_parameters():
            if canonical_name(name) in self.stateless:
                self.optimizer.state.pop(param, None)  # the state a fresh optimizer made up for the load
        self.stateless = set()


class SchedulerState(Stateful):
    """The LR schedule's position. Its shape comes from this run's config (training.steps may
    have grown), so loading recomputes the current lr by stepping into the saved position."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _torch_compat.LR_SCHEDULER_STEP_COUNT.of(self.scheduler)  # the counter the state's key names
        state = dict(state_dict)
        epoch, count = state.get("last_epoch"), state.get(STEP_COUNT)
        if not _is_count(epoch) or not _is_count(count):
            raise CheckpointError(f"lr_scheduler state has last_epoch {epoch!r} and {STEP_COUNT} {count!r}")
        # One step short of the saved position, then step(): the scheduler computes the lr itself
        # from this run's schedule and sets it on the optimizer (and its get_last_lr()).
        state.update({"last_epoch": epoch - 1, STEP_COUNT: count - 1})
        self.scheduler.load_state_dict(state)
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": not a training step
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*optimizer.step.*")
            warnings.filterwarnings("ignore", message=".*optimizer.step.*lr_scheduler.*")
            self.scheduler.step()


class LoaderState(Stateful):
    """The data position: samples consumed (and drawn per mixture source), the same on every rank
    and layout. Streams add one entry per virtual shard, from the ranks that read it (all equal):
    every key a rank saves or loads is either global or a shard's, so DCP's dedup keeps one copy
    and a rank of another DP degree finds the shards it reads now."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)


class TrainState(Stateful):
    """Step and tokens seen. Tokens are counted per data-parallel rank, so a resume with another
    data-parallel degree rescales them (the global count is what is preserved)."""

    def __init__(self, dp_degree: int) -> None:
        self.dp_degree = dp_degree
        self.step = 0
        self.tokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "dp_degree": self.dp_degree}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        step, tokens = state_dict.get("step"), state_dict.get("tokens_seen")
        saved_dp = state_dict.get("dp_degree", self.dp_degree)
        if not (_is_count(step) and _is_count(tokens) and _is_count(saved_dp) and saved_dp > 0):
            raise CheckpointError(
                f"train_state is {{step: {step!r}, tokens_seen: {tokens!r}, dp_degree: {saved_dp!r}}}, "
                "expected non-negative integers"
            )
        self.step = step
        self.tokens_seen = tokens * saved_dp // self.dp_degree


class RNGState(Stateful):
    """This rank's random generators, under ``rank{r}`` (each rank has its own streams)."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.key = f"rank{rank}"
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        state = {"torch_cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["torch_cuda"] = torch.cuda.get_rng_state(self.device)
        return {self.key: state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rng = state_dict[self.key]
        torch.set_rng_state(rng["torch_cpu"])
        if "torch_cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["torch_cuda"], self.device)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0

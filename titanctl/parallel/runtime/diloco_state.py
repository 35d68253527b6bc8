"""DiLoCo's own state in the checkpoints: each fragment's global weights and outer optimizer momentum.

Between two syncs a DiLoCo group's model holds its local weights; the global weights (the model as of
each fragment's last sync, from which the next sync's pseudo-gradient is taken) and the outer SGD's
momentum live in torchft's ``DiLoCo`` only. A checkpoint taken between syncs needs them for a restart
to continue exactly. They are read and restored through the save/load pair each fragment registers
with torchft's Manager for its own heals, and stored under the model's canonical names
(``diloco.global.<name>``, ``diloco.outer_momentum.<name>``), sharded like the model's weights (DTensors
under FSDP/TP), so a checkpoint resumes under another layout or fragment count as the model does.

The checkpoint is loaded before the ``DiLoCo`` object exists (it is created around the training loop):
a load then holds the tensors until ``attach`` hands them to the new object, before the first step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from titanctl import _torch_compat
from titanctl.parallel.layouts.weight_init import canonical_name
from titanctl.parallel.runtime import ft_state

PART = "diloco"  # its entries' prefix in a checkpoint (titanctl.checkpoint.run.load_plan.STATE_PARTS)
GLOBAL, MOMENTUM = "global.", "outer_momentum."


class DiLoCoState(Stateful):
    """``model``: the module DiLoCo's fragments are cut from; ``momentum``: whether the outer SGD keeps a
    momentum buffer (outer_momentum > 0)."""

    def __init__(self, model: nn.Module, manager: Any, momentum: bool) -> None:
        self.model = model
        self.names: dict[int, str] = {}  # a weight's canonical name, by the weight's id (once attached)
        self.manager = manager
        self.momentum = momentum
        self.fragments: list[nn.Module] | None = None
        self.pending: dict[str, Any] | None = None  # loaded before attach

    def attach(self, fragments: list[nn.Module]) -> None:
        """DiLoCo exists (its fragments registered with the Manager): a loaded state goes into it now."""
        self.fragments = fragments
        self.names = {id(p): name for name, p in self._params().items()}
        if self.pending is not None:
            self._restore(self.pending)
            self.pending = None

    def state_dict(self) -> dict[str, Any]:
        if self.fragments is None:  # what a load fills: one tensor per weight, laid out like it
            params = self._params()
            state = {GLOBAL + name: torch.zeros_like(p.detach()) for name, p in params.items()}
            if self.momentum:
                state.update({MOMENTUM + name: torch.zeros_like(p.detach()) for name, p in params.items()})
            return state
        state = {}
        for i, fragment in enumerate(self.fragments):
            save, _ = _torch_compat.diloco_fragment_state_fns(self.manager, i)
            saved = save()
            momentum = saved["outer_optimizer"]["state"]
            for index, (name, p) in enumerate(fragment.named_parameters()):
                key = self.names[id(p)]
                state[GLOBAL + key] = _like(p, saved["original_parameters"][name])
                if self.momentum:
                    # Before the fragment's first outer step SGD has no buffer yet: zeros step the same
                    # (dampening 0: 0 * momentum + g is g, as SGD's first buffer is).
                    buf = momentum.get(index, {}).get("momentum_buffer")
                    state[MOMENTUM + key] = torch.zeros_like(p.detach()) if buf is None else buf
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.fragments is None:
            self.pending = state_dict
        else:
            self._restore(state_dict)

    def _restore(self, state: dict[str, Any]) -> None:
        for i, fragment in enumerate(self.fragments):
            save, load = _torch_compat.diloco_fragment_state_fns(self.manager, i)
            outer = save()["outer_optimizer"]  # its param_groups: this run's outer_lr, momentum, nesterov
            params, momentum = {}, {}
            for index, (name, p) in enumerate(fragment.named_parameters()):
                key = self.names[id(p)]
                params[name] = ft_state.local(state[GLOBAL + key])
                if self.momentum:
                    momentum[index] = {"momentum_buffer": state[MOMENTUM + key]}
            load({"original_parameters": params, "outer_optimizer": {**outer, "state": momentum}})

    def _params(self) -> dict[str, nn.Parameter]:
        return {canonical_name(name): p for name, p in self.model.named_parameters()}


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """torchft keeps this rank's shard of a sharded weight: as a DTensor laid out like the weight."""
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                  stride=param.stride(), run_check=False)
    return local

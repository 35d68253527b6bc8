"""What a replica group hands a healing peer, as plain local tensors, and how it takes it back.

Every replica group has the same layout, so rank r of one group holds exactly the shards that rank r
of another holds: a peer's state travels shard by shard (torchft's checkpoint transport sends rank r's
to rank r) and is copied into the receiver's own DTensors, with no resharding and no process group.
Plain tensors, not DTensors: a DTensor pickles with its device mesh, which names the sender's groups.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def model_state(parts: list[torch.nn.Module]) -> list[dict[str, torch.Tensor]]:
    """Each part's parameters and persistent buffers, as this rank's shards (views, not copies)."""
    return [{name: local(t).detach() for name, t in part.state_dict().items()} for part in parts]


@torch.no_grad()
def load_model_state(parts: list[torch.nn.Module], state: list[dict[str, torch.Tensor]]) -> None:
    for part, saved in zip(parts, state, strict=True):
        mine = part.state_dict()
        if mine.keys() != saved.keys():
            raise RuntimeError(f"a healing peer sent other tensors: {sorted(set(mine) ^ set(saved))[:4]}")
        for name, t in mine.items():
            local(t).copy_(saved[name])


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    # torch.optim numbers parameters in this order in its state_dict
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    state = optimizer.state_dict()
    return {
        "state": {i: {k: local(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                  for i, s in state["state"].items()},
        "param_groups": state["param_groups"],
    }


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Wraps each shard back into a DTensor placed like its parameter, then loads the whole dict (a
    fresh optimizer, whose state is still empty, takes it too)."""
    params = _params(optimizer)
    rebuilt = {}
    for i, entries in state["state"].items():
        p = params[int(i)]
        rebuilt[int(i)] = {
            k: (DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
                if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == p.to_local().shape else v)
            for k, v in entries.items()
        }
    optimizer.load_state_dict({"state": rebuilt, "param_groups": state["param_groups"]})

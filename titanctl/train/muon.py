"""Muon (Moonlight's recipe) for hidden matrices, AdamW for the rest, in one optimizer.

A group with ``kind = "muon"`` updates each parameter with the orthogonalized Nesterov momentum:

    buf = momentum * buf + g;  u = NS5(g + momentum * buf)
    W  -= lr * wd * W + lr * 0.2 * sqrt(max(m, n)) * u

where NS5 is five Newton-Schulz steps with the quintic coefficients (3.4445, -4.7750, 2.0315) and the
0.2 * sqrt(max(m, n)) factor gives the update the RMS of an AdamW update, so one lr serves both kinds.
A 3-D parameter (a stack of routed experts [E, m, n]) is E matrices, each orthogonalized on its own.
A group with ``kind = "adamw"`` is torch's AdamW written out (decoupled decay, bias correction).

Sharded parameters (DTensors under FSDP, TP, EP, and their strided compositions) are orthogonalized
whole, once in the world: every rank of the parameter's mesh gathers the full update direction, the
matrices of each shape are dealt round-robin to the mesh's ranks, each rank runs Newton-Schulz on its own
share, broadcasts each result over the mesh (one broadcast per mesh dimension), and every rank keeps its
own shard. So every layout computes what one process computes, with about 1/mesh-size of the
Newton-Schulz FLOPs per rank. Dealing each shape on its own (rather than all matrices in one round)
gives rank 0 the first matrix of every shape, so rank 0 holds the largest Newton-Schulz temporaries of
any rank whatever the model's depth: estimate-memory, which measures rank 0 on models of 4 and 5 blocks
and extrapolates in depth, then sees the same largest temporaries as the full model has.

Every state buffer is made at the start of the first step (as torch's optimizers do), so the first
step's optimizer phase holds what every later one holds.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to ``g`` [..., m, n], approximately (singular values in ~[0.7, 1.2])."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:  # iterate on the wide side: X @ X^T is then the smaller square
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        s = x @ x.mT  # (..., min, min)
        x = a * x + (b * s + c * s @ s) @ x
    return (x.mT if tall else x).to(g.dtype)


def newton_schulz_flops(shape: torch.Size, steps: int) -> int:
    """Multiply-adds x 2 of ``newton_schulz`` on a [..., m, n] tensor."""
    small, large = sorted(shape[-2:])
    per_step = 2 * small * small * large * 2 + 2 * small**3  # X X^T and B X; A A
    return math.prod(shape[:-2]) * steps * per_step


def _owner_broadcast(full: torch.Tensor, mesh, owner: tuple[int, ...]) -> None:
    """Give every rank of ``mesh`` the owner's ``full``: a broadcast from the owner's coordinate along each
    mesh dimension in turn leaves each rank the value at the owner's coordinates."""
    for dim, src in enumerate(owner):
        if mesh.size(dim) > 1:
            dist.broadcast(full, group=mesh.get_group(dim), group_src=src)


class Muon(torch.optim.Optimizer):
    """Muon for groups marked ``kind = "muon"``, AdamW for groups marked ``kind = "adamw"``."""

    def __init__(
        self,
        param_groups: list[dict],
        lr: float,
        weight_decay: float,
        momentum: float = 0.95,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.float32,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, betas=betas, eps=eps, kind="muon",
            ns_steps=ns_steps,
        )
        self.ns_dtype = ns_dtype
        self.ns_flops = 0  # Newton-Schulz FLOPs this rank ran (each sharded matrix runs on one rank of its mesh)
        super().__init__(param_groups, defaults)
        for group in self.param_groups:
            if group["kind"] == "muon":
                for p in group["params"]:
                    if p.dim() < 2:
                        raise ValueError(f"Muon needs matrices, got a parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        dealt: dict = {}  # (DeviceMesh, shape) -> how many of its matrices of that shape were dealt this step
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._init_state(p, group["kind"])
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["kind"] == "muon":
                    self._muon(p, group, dealt)
                else:
                    self._adamw(p, group)
        return loss

    def _orthogonalized(self, update: torch.Tensor, steps: int, dealt: dict) -> torch.Tensor:
        """Newton-Schulz of the whole matrix behind ``update``, returned with ``update``'s layout."""
        if not isinstance(update, DTensor):
            self.ns_flops += newton_schulz_flops(update.shape, steps)
            return newton_schulz(update, steps, self.ns_dtype)
        mesh = update.device_mesh
        full = update.full_tensor()
        key = (mesh, tuple(full.shape))  # DeviceMesh hashes by its ranks and dimension names
        turn = dealt.get(key, 0)
        dealt[key] = turn + 1
        owner, index = [], turn % mesh.size()  # the turn's coordinates in the mesh (row-major), in plain ints:
        for size in reversed(mesh.shape):  # no tensor, so it also runs under estimate-memory's fake tensors
            index, coordinate = divmod(index, size)
            owner.insert(0, coordinate)
        owner = tuple(owner)
        if tuple(mesh.get_coordinate()) == owner:
            self.ns_flops += newton_schulz_flops(full.shape, steps)
            full = newton_schulz(full, steps, self.ns_dtype)
        _owner_broadcast(full, mesh, owner)
        # Every rank now holds the same full result, so cutting out its own shard needs no communication.
        return distribute_tensor(full, mesh, update.placements, src_data_rank=None)

    def _init_state(self, p: torch.Tensor, kind: str) -> None:
        state = self.state[p]
        if kind == "muon" and "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        elif kind == "adamw" and "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)

    def _muon(self, p: torch.Tensor, group: dict, dealt: dict) -> None:
        state = self.state[p]
        buf, mu = state["momentum_buffer"], group["momentum"]
        buf.mul_(mu).add_(p.grad)
        update = self._orthogonalized(p.grad + mu * buf, group["ns_steps"], dealt)
        m, n = p.shape[-2:]
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update, alpha=-group["lr"] * 0.2 * math.sqrt(max(m, n)))

    def _adamw(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        (beta1, beta2), lr = group["betas"], group["lr"]
        state["step"] += 1
        step = state["step"].item()
        g, exp_avg, exp_avg_sq = p.grad, state["exp_avg"], state["exp_avg_sq"]
        p.mul_(1 - lr * group["weight_decay"])
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
        p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))

"""Parallel degrees -> a validated layout and its DeviceMesh."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from torch.distributed.device_mesh import init_device_mesh

from titanctl import _torch_compat
from titanctl.config.job_config import Parallelism
from titanctl.errors import ParallelError
from titanctl.parallel.runtime import peers
from titanctl.parallel.runtime.env import device_type

# Outermost to innermost: pipeline stages talk least, tensor parallel talks most.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    world_size: int
    ep: int = 1  # expert parallel: a split of dp_shard x cp, not a dimension of its own
    cp_ulysses: int = 1  # ulysses_ring: cp read as cp_ring x cp_ulysses (Ulysses innermost); 1 otherwise

    @classmethod
    def from_config(cls, cfg: Parallelism, world_size: int) -> ParallelDims:
        pp, rep, cp, tp = (
            cfg.pipeline_parallel_degree,
            cfg.data_parallel_replicate_degree,
            cfg.context_parallel_degree,
            cfg.tensor_parallel_degree,
        )
        shard = cfg.data_parallel_shard_degree
        others = pp * rep * cp * tp
        if shard == -1:
            if world_size % others:
                raise ParallelError(
                    f"world size {world_size} is not divisible by pp {pp} x dp_replicate {rep} x "
                    f"cp {cp} x tp {tp} = {others}, so no data_parallel_shard_degree fits"
                )
            shard = world_size // others
        if others * shard != world_size:
            raise ParallelError(
                f"parallel degrees pp {pp} x dp_replicate {rep} x dp_shard {shard} x cp {cp} x tp {tp} "
                f"= {others * shard}, but the world size is {world_size}"
            )
        ep = cfg.expert_parallel_degree
        if (shard * cp) % ep:
            raise ParallelError(
                f"expert_parallel_degree = {ep} must divide data_parallel_shard_degree {shard} x "
                f"context_parallel_degree {cp} = {shard * cp}: experts are split over those ranks"
            )
        ulysses = 1
        if cp > 1:  # (the CP keys are read only where CP runs: commands without it refuse them)
            method, ulysses = cfg.context_parallel_method, cfg.context_parallel_ulysses_degree
            if method == "ulysses_ring":
                from titanctl.parallel.layouts.ulysses_ring import check_ulysses_ring

                check_ulysses_ring(cp, ulysses)  # the degrees; the heads are checked with the model (check_layout)
            elif ulysses != 1:
                raise ParallelError(f"context_parallel_ulysses_degree = {ulysses} needs context_parallel_method = "
                                    f"ulysses_ring, not {method}")
        return cls(pp=pp, dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp, world_size=world_size, ep=ep,
                   cp_ulysses=ulysses)

    @property
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        # Context parallel ranks hold the same weights but see different tokens: their gradients
        # must be reduced over cp too, so cp always shards with FSDP (HSDP beside replicas).
        return self.dp_shard > 1 or self.cp > 1

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and not self.fsdp_enabled

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.fsdp_enabled

    def describe(self) -> str:
        used = [f"{k} {v}" for k, v in self.degrees.items() if v > 1]
        if self.ep > 1:
            used.append(f"(experts: ep {self.ep})")
        return " x ".join(used) if used else "single process"

    @cached_property
    def mesh(self):
        """The world mesh over the dims of size > 1, plus flattened combinations (see mesh_for)."""
        names = [n for n in MESH_DIMS if self.degrees[n] > 1] or ["dp_shard"]
        sizes = {**self.degrees, "cp_ring": self.cp // self.cp_ulysses, "cp_ulysses": self.cp_ulysses}
        if self.cp_ulysses > 1:  # ulysses_ring: cp as (ring, ulysses), flattened back to "cp" below
            names = [m for n in names for m in (("cp_ring", "cp_ulysses") if n == "cp" else (n,))]
        with peers.connecting():
            mesh = init_device_mesh(device_type(), [sizes[n] for n in names], mesh_dim_names=tuple(names))
        combos = (("dp_replicate", "dp_shard"), ("dp_shard", "cp"), ("dp_replicate", "dp_shard", "cp"))
        if self.cp_ulysses > 1:
            combos = (("cp",), *combos)
        for parts in combos:
            present = [p for p in parts if self.degrees[p] > 1]
            dims = [m for n in present for m in (("cp_ring", "cp_ulysses") if n == "cp" and self.cp_ulysses > 1
                                                 else (n,))]
            if len(dims) > 1:
                _torch_compat.flatten_mesh(mesh[tuple(dims)], "_".join(present))
        return mesh

    def mesh_for(self, *parts: str):
        """The 1-D mesh spanning the given dims (flattened when several), or None if all are 1.

        mesh_for("dp_replicate", "dp_shard") holds the ranks that read different data;
        mesh_for("dp_shard", "cp") is what FSDP shards over.
        """
        present = [p for p in parts if self.degrees[p] > 1]
        if not present:
            return None
        return self.mesh["_".join(present)]

    def fsdp_mesh(self):
        """FSDP's mesh: 1-D over dp_shard x cp, or 2-D (dp_replicate, dp_shard x cp) for HSDP."""
        shard = [p for p in ("dp_shard", "cp") if self.degrees[p] > 1]
        if self.dp_replicate > 1:
            return self.mesh[("dp_replicate", "_".join(shard))]
        return self.mesh["_".join(shard)]

    @cached_property
    def expert_mesh(self):
        """The routed experts' mesh (pp, dp_replicate, efsdp, ep, tp) over the same ranks as ``mesh``:
        dp_shard x cp (cp innermost) read as efsdp x ep, so an expert-parallel group is ep ranks that
        are neighbours there. Experts are split over "ep" and FSDP-sharded over "efsdp" (size 1 too:
        FSDP then only reduces their gradients)."""
        efsdp = self.dp_shard * self.cp // self.ep
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "efsdp": efsdp, "ep": self.ep, "tp": self.tp}
        names = [n for n, size in sizes.items() if size > 1 or n in ("efsdp", "ep")]
        with peers.connecting():
            return init_device_mesh(device_type(), [sizes[n] for n in names], mesh_dim_names=tuple(names))

    def expert_fsdp_mesh(self):
        """FSDP's mesh for the experts: efsdp, or (dp_replicate, efsdp) beside replicas."""
        if self.dp_replicate > 1:
            return self.expert_mesh[("dp_replicate", "efsdp")]
        return self.expert_mesh["efsdp"]

"""Mixture-of-Experts load balancing around the training step, and the expert-load metrics.

Both balancing methods are defined on the global batch, so every layout gives the one-process result:
- The auxiliary-loss-free bias update (``moe.load_balance_coeff``, DeepSeek-V3): after each
  optimizer step, every MoE layer's ``expert_bias`` moves by the coefficient toward the experts that
  received fewer tokens than the mean over the global batch (all microbatches, all data-parallel
  and context-parallel ranks): b_e += coeff x sign(mean - tokens_e).
  An MoE layer is a module that counts its tokens (a ``tokens_per_expert`` buffer: the shared MoE, or a
  family's own that keeps the same buffers); one without an ``expert_bias`` (a hash-routed layer, whose
  choice is a fixed table) is counted for the metrics and has no bias to move.
- The auxiliary loss (``moe.router_aux_loss_coef``, as Qwen3-MoE trains): per sequence, averaged
  over sequences and MoE layers (models/common/moe.py computes it). Sequences are whole on one rank
  except under context parallel, whose ranks sum their statistics, so the objective does not
  depend on how a step's sequences are split over ranks and microbatches.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from titanctl.config.job_config import MoEBalancing
from titanctl.errors import ConfigError
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.moe import MoE
from titanctl.models.registry import get_spec
from titanctl.parallel.layouts.dims import ParallelDims

_LAYER_ID = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_moe_keys(cfg: MoEBalancing, args: ModelArgs, family: str) -> None:
    """The balancing keys need MoE layers that train by them (a key that does nothing is refused)."""
    not_built = get_spec(family).moe_keys_not_built
    for key in ("load_balance_coeff", "router_aux_loss_coef"):
        value = getattr(cfg, key)
        if value and args.moe is None:
            raise ConfigError(f"moe.{key} = {value} needs a Mixture-of-Experts model; "
                              f"{family} has no MoE layers: set it to 0 or use e.g. model.name = qwen3_moe")
        if value and key in not_built:
            raise ConfigError(f"moe.{key} = {value}: {not_built[key]}; set it to 0")


class MoEBalance:
    """The MoE layers of this rank's model parts, set up for balancing; ``after_step`` runs after
    every optimizer step and returns the step's expert load."""

    def __init__(self, model_parts: list[torch.nn.Module], cfg: MoEBalancing, args: ModelArgs,
                 dims: ParallelDims, microbatches_per_step: int):
        self.load_balance_coeff = cfg.load_balance_coeff
        self.layers: dict[int, torch.nn.Module] = {}
        for part in model_parts:
            for name, module in part.named_modules():
                if isinstance(getattr(module, "tokens_per_expert", None), torch.Tensor):
                    self.layers[int(_LAYER_ID.search("." + name).group(1))] = module
        # Ranks holding the same layers but different tokens: data parallel and context parallel.
        data_mesh = dims.mesh_for("dp_replicate", "dp_shard", "cp") if dims.world_size > 1 else None
        self.data_group = None if data_mesh is None else data_mesh.get_group()
        cp_mesh = dims.mesh_for("cp") if dims.world_size > 1 else None
        # Each microbatch's loss enters the step's objective with weight 1 / microbatches (a pipeline
        # splits a microbatch again); context-parallel ranks each hold a share of a sequence's loss,
        # and their gradients are averaged; and the loss is the mean over MoE layers.
        n_moe_layers = sum(args.is_moe_layer(i) for i in range(args.n_layers + args.mtp_layers))
        weight = cfg.router_aux_loss_coef * dims.cp / (microbatches_per_step * max(n_moe_layers, 1))
        for module in self.layers.values():
            if not isinstance(module, MoE):  # a family's own MoE has no auxiliary loss (its spec refuses the key)
                continue
            module.aux_loss_coef = weight
            module.reduce_sequence_sums = None if cp_mesh is None else _summed_over(cp_mesh.get_group())

    @torch.no_grad()
    def after_step(self) -> dict[int, torch.Tensor]:
        """{layer id: tokens per expert over the global batch} of this rank's layers; applies the
        bias update, and starts counting the next step."""
        if not self.layers:
            return {}
        ids = sorted(self.layers)
        counts = torch.stack([self.layers[i].tokens_per_expert for i in ids])  # (layers, experts)
        if self.data_group is not None:
            dist.all_reduce(counts, group=self.data_group)
        for layer_id, layer_counts in zip(ids, counts):
            module = self.layers[layer_id]
            if self.load_balance_coeff and hasattr(module, "expert_bias"):
                module.expert_bias.add_(torch.sign(layer_counts.mean() - layer_counts) * self.load_balance_coeff)
            module.tokens_per_expert.zero_()
        return dict(zip(ids, counts))


def _summed_over(group):
    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t
    return reduce


def gather_over_pipeline(load: dict[int, torch.Tensor], dims: ParallelDims) -> dict[int, torch.Tensor]:
    """Every stage's layers' load on every rank of the pipeline group (a collective over it)."""
    if dims.pp == 1:
        return load
    stages: list = [None] * dims.pp
    dist.all_gather_object(stages, {i: c.cpu() for i, c in load.items()}, group=dims.mesh["pp"].get_group())
    return {i: c for stage in stages for i, c in sorted(stage.items())}


def load_metrics(load: dict[int, torch.Tensor]) -> dict:
    """metrics.jsonl fields of one step's expert load (over the global batch): tokens per expert and
    max/mean per layer, and the largest max/mean of any layer (a scalar for TensorBoard)."""
    imbalance = {i: float(counts.max() / counts.mean()) for i, counts in sorted(load.items())}
    return {
        "expert_load": {str(i): [int(c) for c in counts.tolist()] for i, counts in sorted(load.items())},
        "expert_imbalance": {str(i): round(v, 4) for i, v in imbalance.items()},
        "expert_imbalance_max": round(max(imbalance.values()), 4),
    }

"""Activation checkpointing: whole blocks (full), every N-th block, or a save-list of ops."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanctl import _torch_compat
from titanctl.config.job_config import ActivationCheckpoint
from titanctl.errors import ConfigError
from titanctl.parallel.converters import onednn_linear  # noqa: F401 (registers torch.ops.titanctl.onednn_mm_t)

aten = torch.ops.aten
# The ops a linear's product runs as: aten's, and oneDNN's (training.cpu_linear, the default on AVX-512 CPUs).
# Without the latter, op-level AC saved no linear's output on those CPUs (estimate-memory's exact peak for the
# debug recipes was then about full AC's, the plan's fast path 15-20% above it).
MATMULS = (aten.mm.default, torch.ops.titanctl.onednn_mm_t.default)


def _save_ops() -> set:
    """Outputs worth keeping: attention (every backend, the CPU one included) and reductions that
    are cheap to store but need communication to recompute."""
    return {entry.get() for entry in _torch_compat.SAC_SAVE_OPS} | {aten.max.default}


def _op_policy(save_ops: set):
    """Save ``save_ops`` and every other matmul; recompute the rest."""
    mm_count: dict[str, int] = defaultdict(int)

    def policy(ctx, op, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if op in MATMULS:
            mm_count[mode] += 1
            # Recompute every second matmul so that about half the matmul outputs are kept.
            if mm_count[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_ac(model: nn.Module, cfg: ActivationCheckpoint) -> None:
    if cfg.mode == "none":
        return
    option = cfg.selective_ac_option
    every = 1
    if cfg.mode == "selective" and option != "op":
        if not option.isdigit() or int(option) < 1:
            raise ConfigError(
                f"config key 'activation_checkpoint.selective_ac_option' = {option!r} must be a positive "
                "integer (checkpoint every N-th block) or 'op'"
            )
        every = int(option)
    checkpoint_wrapper = _torch_compat.CHECKPOINT_WRAPPER.get()
    save_ops = _save_ops() if cfg.mode == "selective" and option == "op" else set()
    for index, (layer_id, block) in enumerate(list(model.layers.items())):
        if cfg.mode == "selective" and option == "op":
            wrapped = checkpoint_wrapper(
                block, context_fn=lambda: create_selective_checkpoint_contexts(_op_policy(save_ops)),
                preserve_rng_state=False,
            )
        elif index % every == 0:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            continue
        model.layers[layer_id] = wrapped

"""Pipeline parallelism: cut the meta model into stages, place them on ranks, run a schedule.

``build_pipeline`` returns a ``Pipeline`` whose ``model_parts`` are still on the meta device:
the caller materializes them (``to_empty`` + ``initialize_weights``, or a checkpoint load)
before the first ``step``, exactly as for a model without pipelining. Stages infer the shapes
they exchange from the first microbatch, so nothing needs real weights before then.

Stage placement: one stage per rank for GPipe/1F1B; stage ``s`` on rank ``s % pp`` ("loop")
for Interleaved1F1B, LoopedBFS and InterleavedZeroBubble; rank ``r`` holding stages ``r`` and
``2 * pp - 1 - r`` ("V") for ZBVZeroBubble and DualPipeV; whatever the file says for a CSV
schedule.

Gradient scale: torch's ``scale_grads=True`` divides every ``.grad`` of a stage by the number
of microbatches after the step's last backward, which also shrinks gradients left over from an
earlier ``step`` (gradient accumulation). So we pass ``scale_grads=False`` and divide each
microbatch loss by the microbatch count before its backward instead: gradients are those of
the mean loss over the batch (equal-size microbatches), times ``loss_scale``. The trainer's loss
is a sum over counted tokens instead (titanctl/train/loss.py): it passes ``loss_divisor``, and
each microbatch's loss is divided by it, whatever the microbatch count.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from titanctl import _torch_compat
from titanctl.config.job_config import Parallelism
from titanctl.errors import ParallelError
from titanctl.models.registry import spec_of
from titanctl.parallel.layouts.pipeline_stages import (
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    check_schedule_name,
    pipeline_layer_ranges,
)


def stage_ids_for_rank(rank: int, pp_degree: int, num_stages: int, style: str) -> list[int]:
    """The stages rank ``rank`` runs: ``style`` "loop" (round robin) or "v" (2 per rank, folded)."""
    if style == "loop":
        return list(range(rank, num_stages, pp_degree))
    if style == "v":
        if num_stages != 2 * pp_degree:
            raise ValueError(f"V placement needs 2 stages per rank, got {num_stages} over {pp_degree}")
        return [rank, num_stages - 1 - rank]
    raise ValueError(f"unknown stage placement {style!r}")


def read_schedule_csv(path: str | Path, pp_degree: int) -> tuple[dict[int, int], int]:
    """Check a compute-only schedule CSV (one row of actions like ``0F1``, ``2B0`` per rank).

    Returns (stage -> rank, microbatch count).
    """
    action_class = _torch_compat.PIPELINE_ACTION.get()
    where = f"schedule CSV {str(path)!r}"
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except OSError as e:
        raise ParallelError(
            f"cannot read pipeline_parallel_schedule_csv {str(path)!r}: {e.strerror}"
        ) from None
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()  # trailing blank lines
    if len(rows) != pp_degree:
        raise ParallelError(
            f"{where} has {len(rows)} rows, but pipeline_parallel_degree is {pp_degree} "
            f"(one row of actions per rank)"
        )
    stage_to_rank: dict[int, int] = {}
    microbatches: set[int] = set()
    for rank, row in enumerate(rows):
        for col, cell in enumerate(row):
            try:
                action = action_class.from_str(cell)
            except RuntimeError:
                action = False  # torch's parser accepts a prefix: compare the round trip below
            if action is None:
                continue
            if action is False or str(action) != cell.strip():
                raise ParallelError(
                    f"{where} row {rank + 1} column {col + 1}: {cell.strip()!r} is not "
                    f"an action like 0F1 (stage, F/B/I/W, microbatch)"
                )
            if not action.is_compute_op or action.microbatch_index is None:
                raise ParallelError(
                    f"{where} row {rank + 1} column {col + 1}: {cell.strip()!r} is not a "
                    f"compute action (only F, B, I, W with a microbatch; communication is added "
                    f"automatically)"
                )
            owner = stage_to_rank.setdefault(action.stage_index, rank)
            if owner != rank:
                raise ParallelError(
                    f"{where}: stage {action.stage_index} appears on rank {owner} and rank {rank}"
                )
            microbatches.add(action.microbatch_index)
    num_stages = max(stage_to_rank, default=-1) + 1
    absent = sorted(set(range(num_stages)) - set(stage_to_rank))
    if absent or not microbatches:
        raise ParallelError(f"{where} runs no action for stages {absent or 'any'}")
    n_mb = max(microbatches) + 1
    if sorted(microbatches) != list(range(n_mb)):
        skipped = sorted(set(range(n_mb)) - microbatches)
        raise ParallelError(f"{where} skips microbatches {skipped}")
    return stage_to_rank, n_mb


def microbatch_count(
    local_batch_size: int, microbatch_size: int, schedule: str | None, num_stages: int, pp_degree: int
) -> int:
    """Microbatches per step, checked against what the schedule can run."""
    if local_batch_size % microbatch_size:
        raise ParallelError(
            f"training.local_batch_size {local_batch_size} is not divisible by "
            f"parallelism.pipeline_parallel_microbatch_size {microbatch_size}"
        )
    n_mb = local_batch_size // microbatch_size
    if schedule in ("1F1B", "DualPipeV") and n_mb < num_stages:
        raise ParallelError(
            f"schedule {schedule} needs at least as many microbatches as stages: local_batch_size "
            f"{local_batch_size} / microbatch_size {microbatch_size} = {n_mb} microbatches "
            f"< {num_stages} stages"
        )
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n_mb // pp_degree)
        if n_mb % rounds:
            raise ParallelError(
                f"schedule {schedule} runs microbatches in rounds of {n_mb // rounds}: "
                f"{n_mb} microbatches (local_batch_size {local_batch_size} / microbatch_size "
                f"{microbatch_size}) must be a multiple of {rounds} (= {n_mb} // pipeline_parallel_degree "
                f"{pp_degree})"
            )
    return n_mb


class _MicrobatchLoss:
    """The user's loss, times ``factor`` (= loss_scale / n_microbatches) so backward sums to the mean."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.loss_fn = loss_fn
        self.factor = 1.0

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) * self.factor


@dataclass
class Pipeline:
    schedule: object  # a torch.distributed.pipelining schedule
    stages: list  # this rank's PipelineStage objects, in stage order
    n_microbatches: int
    _loss: _MicrobatchLoss
    _checked: bool = field(default=False, repr=False)

    @property
    def model_parts(self) -> list[nn.Module]:
        """This rank's stage modules, in stage order (for the optimizer, init and checkpoints)."""
        return [stage.submod for stage in self.stages]

    @property
    def has_first_stage(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def has_last_stage(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def step(
        self, inputs: torch.Tensor, labels: torch.Tensor, *, loss_scale: float = 1.0,
        loss_divisor: torch.Tensor | float | None = None, **model_kwargs,
    ) -> torch.Tensor | None:
        """Forward and backward over one batch (B, T), split into microbatches along B.

        ``model_kwargs`` (e.g. ``attn_mask``) reach every stage's forward, split along B like the
        inputs (a FlexAttention BlockMask too).

        Accumulates into ``.grad`` the gradient of ``loss_scale`` x the mean loss over the batch
        (pass ``1 / accumulation_steps`` when accumulating). Returns the (unscaled, detached)
        mean loss on the rank that runs the last stage, None on the others. With ``loss_divisor`` (a
        loss that sums over tokens) each microbatch's loss is divided by it instead, and the sum of
        those is returned.
        """
        if not self._checked:
            if any(p.is_meta for part in self.model_parts for p in part.parameters()):
                raise RuntimeError(
                    "pipeline stages are still on the meta device: materialize Pipeline.model_parts "
                    "(to_empty + initialize_weights, or load a checkpoint) before the first step"
                )
            self._checked = True
        self._loss.factor = loss_scale / self.n_microbatches if loss_divisor is None else 1 / loss_divisor
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        args = (inputs,) if self.has_first_stage else ()
        target = labels if self.has_last_stage else None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **model_kwargs)
        if losses is None:
            return None
        total = torch.stack([loss.detach() for loss in losses]).sum()
        # Each entry is loss_i * loss_scale / n: their sum / loss_scale is the mean of the loss_i.
        return total if loss_divisor is not None else total / loss_scale

    def eval_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, *, loss_divisor: torch.Tensor | float | None = None,
        **model_kwargs,
    ) -> torch.Tensor | None:
        """Forward only over one batch (B, T) through the same schedule (torch's ``schedule.eval``;
        call it under ``torch.no_grad``): the mean loss over its microbatches on the rank that runs
        the last stage, None on the others (with ``loss_divisor``: the sum of each microbatch's loss
        divided by it). The next ``step`` re-prepares the stages for backward."""
        self._loss.factor = 1.0 / self.n_microbatches if loss_divisor is None else 1 / loss_divisor
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        args = (inputs,) if self.has_first_stage else ()
        target = labels if self.has_last_stage else None
        self.schedule.eval(*args, target=target, losses=losses, return_outputs=False, **model_kwargs)
        if losses is None:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum()


@dataclass(frozen=True)
class PipelinePlan:
    """Which layers each stage holds, which stages each pp rank runs, and the microbatch count: what the
    config and the model's depth decide, checked before any process group exists."""

    schedule_name: str | None  # None: a schedule CSV file
    ranges: list[range]  # stage -> its layers
    stage_ids: dict[int, list[int]]  # pp rank -> its stages
    n_microbatches: int


def plan_pipeline(n_layers: int, p: Parallelism, local_batch_size: int) -> PipelinePlan:
    """The pipeline of ``n_layers`` layers that ``p`` asks for, or a one-line ParallelError."""
    pp_degree = p.pipeline_parallel_degree
    csv_path = p.pipeline_parallel_schedule_csv
    if csv_path:
        schedule_name = None
        stage_to_rank, csv_microbatches = read_schedule_csv(csv_path, pp_degree)
        num_stages = len(stage_to_rank)
    else:
        schedule_name = p.pipeline_parallel_schedule
        check_schedule_name(schedule_name)
        num_stages = None
    ranges = pipeline_layer_ranges(
        n_layers,
        pp_degree,
        schedule_name,
        split_points=p.pipeline_parallel_split_points,
        layers_per_stage=p.pipeline_parallel_layers_per_stage,
        num_stages=num_stages,
    )
    num_stages = len(ranges)
    n_mb = microbatch_count(local_batch_size, p.pipeline_parallel_microbatch_size, schedule_name, num_stages, pp_degree)
    if csv_path:
        if n_mb != csv_microbatches:
            raise ParallelError(
                f"schedule CSV {csv_path!r} runs {csv_microbatches} microbatches, but local_batch_size "
                f"{local_batch_size} / microbatch_size {p.pipeline_parallel_microbatch_size} = {n_mb}"
            )
        stage_ids = {r: sorted(s for s, owner in stage_to_rank.items() if owner == r) for r in range(pp_degree)}
    else:
        style = "v" if schedule_name in V_SCHEDULES else "loop"
        stage_ids = {r: stage_ids_for_rank(r, pp_degree, num_stages, style) for r in range(pp_degree)}
    return PipelinePlan(schedule_name, ranges, stage_ids, n_mb)


def build_pipeline(
    model_meta: nn.Module,
    pp_mesh,
    cfg_parallelism: Parallelism,
    *,
    device: torch.device,
    local_batch_size: int,
    parallelize_fn: Callable[[nn.Module], nn.Module],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Pipeline:
    """Split ``model_meta`` (a whole model on the meta device) into this rank's stages.

    ``parallelize_fn`` (TP, AC, compile, FSDP) runs on each stage before it is wrapped in a
    ``PipelineStage``. The returned ``model_parts`` are still on the meta device: materialize them
    before the first ``step``.
    """
    if loss_fn is None:
        raise ValueError("build_pipeline needs a loss_fn (training runs backward)")
    p = cfg_parallelism
    pp_degree, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    if pp_degree != p.pipeline_parallel_degree:
        raise ValueError(f"the pp mesh has {pp_degree} ranks, the config says {p.pipeline_parallel_degree}")
    plan = plan_pipeline(len(model_meta.layers), p, local_batch_size)
    ranges, n_mb, schedule_name = plan.ranges, plan.n_microbatches, plan.schedule_name
    num_stages = len(ranges)

    group = pp_mesh.get_group()
    stages = []
    for stage_id in plan.stage_ids[pp_rank]:
        module = spec_of(model_meta.args).split_stage(
            model_meta, ranges[stage_id], is_first=stage_id == 0, is_last=stage_id == num_stages - 1
        )
        module = parallelize_fn(module)
        stage = PipelineStage(module, stage_id, num_stages, device, group=group)
        _leave_buffers_unchanged_by_shape_inference(stage)
        stages.append(stage)

    loss = _MicrobatchLoss(loss_fn)
    csv_path = p.pipeline_parallel_schedule_csv
    if csv_path:
        schedule = _torch_compat.PIPELINE_RUNTIME.get()(stages, n_mb, loss_fn=loss, scale_grads=False)
        try:
            _torch_compat.load_schedule_csv(schedule, csv_path)
        except (AssertionError, ValueError, RuntimeError) as e:
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ParallelError(f"schedule CSV {csv_path!r} is not a valid schedule: {first_line}") from None
    else:
        cls = get_schedule_class(schedule_name)
        if issubclass(cls, PipelineScheduleSingle):
            assert schedule_name in SINGLE_STAGE_SCHEDULES and len(stages) == 1
            schedule = cls(stages[0], n_mb, loss_fn=loss, scale_grads=False)
        else:
            schedule = cls(stages, n_mb, loss_fn=loss, scale_grads=False)
    return Pipeline(schedule=schedule, stages=stages, n_microbatches=n_mb, _loss=loss)


def _leave_buffers_unchanged_by_shape_inference(stage: PipelineStage) -> None:
    """The first step infers each stage's shapes by running its forward once more, on the first
    microbatch or on uninitialized tensors: whatever that forward writes into buffers (MoE token
    counts) is undone, so that state changes only with the real microbatches. (torch 2.11 infers
    shapes under no_grad, where nothing is counted.)"""
    if not _torch_compat.torch_at_least("2.12"):
        return
    infer = _torch_compat.STAGE_SET_UP["forward shapes"].of(stage)
    version = _torch_compat.TENSOR_VERSION.of

    def infer_and_restore(*args, **kwargs):
        saved = [(b, version(b), b.clone()) for b in stage.submod.buffers()]
        try:
            return infer(*args, **kwargs)
        finally:
            with torch.no_grad():
                for buffer, saved_version, value in saved:
                    if version(buffer) != saved_version:  # written to (others, such as RoPE's table, are
                        buffer.copy_(value)  # saved for the shapes' backward: left untouched)

    setattr(stage, _torch_compat.STAGE_SET_UP["forward shapes"].path.rsplit(".", 1)[-1], infer_and_restore)

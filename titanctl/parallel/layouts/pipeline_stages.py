"""Which layers each pipeline stage holds, for every schedule.

A stage holds a contiguous run of layers; the first stage also holds ``tok_embeddings``, the
last ``norm`` and ``output``. Layers keep their ids (``layers`` is a ModuleDict), so a stage
holding layers 2-3 names its weights ``layers.2.*`` and ``layers.3.*`` exactly as the whole
model does: checkpoints and weight init need no renaming.

Which stages a rank runs, and how many per rank, depends on the schedule:

- GPipe, 1F1B: one stage per rank.
- Interleaved1F1B, LoopedBFS, InterleavedZeroBubble: several stages per rank (2 by default).
- ZBVZeroBubble, DualPipeV ("V" schedules): exactly 2 stages per rank.

Nothing here imports ``torch.distributed``: this module only does arithmetic on layer ids.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from titanctl.errors import ParallelError

SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", *V_SCHEDULES)
SCHEDULES = SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES
# Zero-bubble schedules run a stage's backward in two passes (inputs' gradients, then the weights'),
# which op-level selective activation checkpointing forbids (it allows one backward per region).
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", *V_SCHEDULES)

_SPLIT_POINT = re.compile(r"layers\.(\d+)")


def default_stages_per_rank(schedule: str) -> int:
    """Stages each rank runs when neither split points nor layers_per_stage say otherwise."""
    check_schedule_name(schedule)
    return 1 if schedule in SINGLE_STAGE_SCHEDULES else 2


def check_schedule_name(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ParallelError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


def _split_layer_id(name: str, n_layers: int) -> int:
    match = _SPLIT_POINT.fullmatch(name.strip())
    if match is None:
        raise ParallelError(
            f"pipeline split point {name!r} is not a layer name like 'layers.4' "
            f"(stages can only start at a transformer layer)"
        )
    layer = int(match.group(1))
    if layer >= n_layers:
        raise ParallelError(
            f"pipeline split point {name!r} names layer {layer}, but the model has {n_layers} layers "
            f"(layers.0 to layers.{n_layers - 1})"
        )
    return layer


def stage_layer_ranges(
    n_layers: int, num_stages: int | None = None, split_points: Sequence[str] = ()
) -> list[range]:
    """The layer ids of each stage, in stage order.

    With ``split_points`` (module names like ``"layers.4"``, each starting a new stage) there are
    ``len(split_points) + 1`` stages; ``num_stages``, if given, must agree. Without them the layers
    are dealt out evenly over ``num_stages`` stages, the first ``n_layers % num_stages`` stages
    taking one extra (the last stage also carries the output projection and the loss).
    Every stage holds at least one layer.
    """
    if split_points:
        starts = [_split_layer_id(name, n_layers) for name in split_points]
        if num_stages is not None and num_stages != len(starts) + 1:
            raise ParallelError(
                f"{len(starts)} pipeline split points make {len(starts) + 1} stages, "
                f"but {num_stages} stages are needed"
            )
        bounds = [0, *starts, n_layers]
        for prev, start, name in zip(bounds, starts, split_points):
            if start <= prev:
                raise ParallelError(
                    f"pipeline split point {name!r} (layer {start}) must come after layer {prev} "
                    f"so every stage holds at least one layer: give split points in increasing order, "
                    f"none at layers.0"
                )
        return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]

    if num_stages is None or num_stages < 1:
        raise ValueError(f"num_stages must be a positive number without split points, got {num_stages}")
    if n_layers < num_stages:
        raise ParallelError(
            f"the model has {n_layers} layers, too few for {num_stages} pipeline stages "
            f"(every stage needs at least one layer)"
        )
    base, extra = divmod(n_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def check_stage_count(num_stages: int, pp_degree: int, schedule: str | None) -> int:
    """Validate ``num_stages`` for ``pp_degree`` ranks and ``schedule``; return stages per rank.

    ``schedule`` None means a schedule read from a CSV file, which decides its own layout.
    """
    if num_stages % pp_degree:
        raise ParallelError(
            f"{num_stages} pipeline stages cannot be spread evenly over pipeline_parallel_degree "
            f"{pp_degree}: the stage count must be a multiple of the degree"
        )
    per_rank = num_stages // pp_degree
    if schedule is None:
        return per_rank
    check_schedule_name(schedule)
    if schedule in SINGLE_STAGE_SCHEDULES and per_rank != 1:
        raise ParallelError(
            f"schedule {schedule} runs one stage per rank, but {num_stages} stages over "
            f"pipeline_parallel_degree {pp_degree} give {per_rank} per rank: use Interleaved1F1B or "
            f"LoopedBFS, or fewer split points"
        )
    if schedule in V_SCHEDULES and per_rank != 2:
        raise ParallelError(
            f"schedule {schedule} needs exactly 2 stages per rank, but {num_stages} stages over "
            f"pipeline_parallel_degree {pp_degree} give {per_rank}"
        )
    if schedule in MULTI_STAGE_SCHEDULES and per_rank < 2:
        raise ParallelError(
            f"schedule {schedule} needs at least 2 stages per rank, but {num_stages} stages over "
            f"pipeline_parallel_degree {pp_degree} give {per_rank}: use GPipe or 1F1B, or more stages"
        )
    return per_rank


def pipeline_layer_ranges(
    n_layers: int,
    pp_degree: int,
    schedule: str | None,
    *,
    split_points: Sequence[str] = (),
    layers_per_stage: int = 0,
    num_stages: int | None = None,
) -> list[range]:
    """The layers of every stage of a pipeline, validated against the degree and the schedule.

    The stage count comes from ``split_points``, else from ``layers_per_stage`` (the last stage
    takes what is left), else from ``num_stages`` (a CSV schedule fixes it), else it is
    ``pp_degree`` times the schedule's default stages per rank.
    """
    if split_points and layers_per_stage:
        raise ParallelError(
            "give either pipeline_parallel_split_points or pipeline_parallel_layers_per_stage "
            f"({layers_per_stage}), not both"
        )
    if layers_per_stage:
        count = math.ceil(n_layers / layers_per_stage)
        if num_stages is not None and count != num_stages:
            raise ParallelError(
                f"pipeline_parallel_layers_per_stage {layers_per_stage} makes {count} stages of "
                f"{n_layers} layers, but the schedule has {num_stages} stages"
            )
        ranges = [range(a, min(a + layers_per_stage, n_layers)) for a in range(0, n_layers, layers_per_stage)]
    elif split_points:
        ranges = stage_layer_ranges(n_layers, num_stages, split_points)
    else:
        if num_stages is None:
            if schedule is None:
                raise ValueError("a CSV schedule must give num_stages")
            num_stages = pp_degree * default_stages_per_rank(schedule)
        ranges = stage_layer_ranges(n_layers, num_stages)
    check_stage_count(len(ranges), pp_degree, schedule)
    return ranges

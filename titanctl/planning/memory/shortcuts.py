"""Which smaller runs stand for the full step: fewer blocks, fewer pipeline microbatches.

Running every block of a deep model, or every microbatch of a long pipeline schedule, on fake
tensors costs time in proportion to their number, while the memory they need grows by the same
amount with each one added. So the estimator runs two smaller sizes and extrapolates each tracked
quantity along the line through them (``estimate._extrapolate``). Both sizes must show every
"place" of the full run (the first and last blocks, the schedule's warm-up, steady state and
cool-down) for that line to be exact; the tests compare it with the full run byte for byte.

- Depth: every block runs the same code, or every group of ``period`` blocks does (every second
  block checkpointed; a hybrid model's layer schedule, three Gated DeltaNet blocks to one of full
  attention). Without pipelines, models of 4 and 5 such groups stand for any depth (``depth_plan``).
  With pipelines, every stage is shortened by the same number of blocks (whole groups, so the
  schedule keeps its phase in every stage), so that this rank's stages keep three blocks: the first
  stage its first two and one after them, the last stage its last two and one before them
  (``pipeline_depth_plan``).
- Pipeline microbatches: past the schedule's warm-up, one more microbatch adds the same memory at
  each place of the step: schedules that keep every microbatch in flight (GPipe, LoopedBFS, the
  zero-bubble ones that defer weight gradients) add its activations; 1F1B-style ones bound what is
  in flight by the number of stages and add only the buffers kept per microbatch (its inputs, the
  received activations and gradients). Places are told apart by the schedule action running
  (``pipeline.label_actions``), so that each grows in its own way; ``microbatch_plan`` picks two
  counts past the warm-up.

Memory is affine in depth and in the microbatch count. Where a schedule keeps every microbatch's
activations of every block (GPipe, LoopedBFS, the zero-bubble ones), it has a term in their
product: with both shortcuts, two depths by two counts. 1F1B adds per microbatch only buffers that
no block changes, so what one more microbatch adds is measured on the shallower model alone: three
runs (``count_slope_at_one_depth``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from titanctl.config.job_config import JobConfig
from titanctl.parallel.layouts.pipeline_parallel import microbatch_count, stage_ids_for_rank
from titanctl.parallel.layouts.pipeline_stages import (
    V_SCHEDULES,
    default_stages_per_rank,
    pipeline_layer_ranges,
    stage_layer_ranges,
)


def ac_period(cfg: JobConfig) -> int:
    """Checkpointing repeats with this period: 2 when every second block is checkpointed, else 1."""
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option.isdigit():
        return max(1, int(ac.selective_ac_option))
    return 1


def schedule_period(layer_types: tuple[str, ...], n_layers: int) -> int:
    """The layer schedule repeats with this period (a hybrid model's every fourth full-attention layer:
    4; no schedule: 1): the shortest p with layer i of the kind of layer i % p."""
    if not layer_types:
        return 1
    kinds = [layer_types[i % len(layer_types)] for i in range(n_layers)]
    return next((p for p in range(1, n_layers + 1) if all(kinds[i] == kinds[i % p] for i in range(n_layers))), 1)


def block_period(cfg: JobConfig, layer_types: tuple[str, ...] = (), n_layers: int = 1) -> int:
    """Blocks repeat with this period: that of checkpointing and of the layer schedule together."""
    return math.lcm(ac_period(cfg), schedule_period(layer_types, n_layers))


def at_depth(args, n_layers: int):
    """``args`` (ModelArgs) with ``n_layers`` blocks, the layer schedule continued over them."""
    types = args.layer_types
    return args.replace(n_layers=n_layers, layer_types=tuple(types[i % len(types)] for i in range(n_layers))
                        if types else types)


def depth_plan(n_layers: int, period: int, all_layers: bool) -> list[int]:
    """Layer counts to run without pipelines: all of them, or two shallow models to extrapolate from.

    Every block runs the same code, so each tracked quantity at a given place of the step (the
    first/second block, the last/second-to-last, the output layer, the optimizer...) grows by the
    same amount per added block: two depths that keep those places distinct (4 and 5 blocks, or 4
    and 5 groups of ``period`` blocks) give it exactly at any depth.
    """
    base = 4 * period + n_layers % period
    if all_layers or n_layers < 2 * (base + period):
        return [n_layers]
    return [base, base + period]


def pipeline_depth_plan(
    n_layers: int, period: int, num_stages: int, stages: list[int], all_layers: bool
) -> list[int]:
    """Model depths to run under a pipeline: all layers, or two models with shorter stages.

    Layers are dealt out evenly, the first ``n_layers % num_stages`` stages taking one more; a model
    ``num_stages * period`` layers shallower has every stage ``period`` layers shorter, the same
    remainder and so the same shape of split. ``stages`` (this rank's) keep at least three groups
    of ``period`` blocks: the first stage its first two blocks and one after them, the last
    stage its last two and one before them, so that every place of the full model is run.
    """
    step = num_stages * period
    sizes = [len(r) for r in stage_layer_ranges(n_layers, num_stages)]
    own = [sizes[s] for s in stages]
    # Shorten by k steps: this rank's stages keep 3 groups, the others at least one block.
    k = min(min(own) // period - 3, (min(sizes) - 1) // period)
    # Two models of k and k - 1 steps shorter must together run fewer of this rank's blocks.
    cheaper = 2 * sum(own) - (2 * k - 1) * period * len(own) < sum(own)
    if all_layers or k < 1 or not cheaper:
        return [n_layers]
    shallow = n_layers - k * step
    return [shallow, shallow + step]


_LAYER_NAME = re.compile(r"^layers\.(\d+)")


def stage_layer_names(depths: list[int], n_layers: int, num_stages: int) -> Callable[[str, str], str]:
    """Name, in the full model, the module where a peak of the two shallow pipeline models happened.

    Given the module of the same peak in the model of ``depths[0]`` and of ``depths[1]`` layers:
    a block that keeps its distance to the start (or to the end) of its stage in both is that far
    from the start (or end) of the full model's stage; any other block is "layers.*".
    """
    ranges = {depth: stage_layer_ranges(depth, num_stages) for depth in (*depths, n_layers)}

    def place(layer: int, depth: int) -> tuple[int, int, int]:
        for stage, r in enumerate(ranges[depth]):
            if layer in r:
                return stage, layer - r.start, r.stop - 1 - layer
        raise ValueError(f"layer {layer} is in no stage of a {depth}-layer model")

    def name(small: str, large: str) -> str:
        a, b = _LAYER_NAME.match(small), _LAYER_NAME.match(large)
        if a is None or b is None:
            return large  # outside the blocks: the same module at every depth
        (s1, start1, end1), (s2, start2, end2) = place(int(a[1]), depths[0]), place(int(b[1]), depths[1])
        full = ranges[n_layers][s2]
        if s1 != s2:
            layer = "*"
        elif start1 == start2:
            layer = str(full.start + start2)
        elif end1 == end2:
            layer = str(full.stop - 1 - end2)
        else:
            layer = "*"
        return _LAYER_NAME.sub(f"layers.{layer}", large)

    return name


def affine_from(schedule: str, pp: int, num_stages: int) -> tuple[int, int]:
    """(first, step): from ``first`` microbatches on, every ``step`` more add the same memory.

    The tracker keeps peaks apart by the schedule action running: forward or backward of which
    stage, for the first microbatch, the last one, or one between (``pipeline.label_actions``).
    ``first`` is the smallest count at which the actions between the first and the last include
    the steady state's, so that their highest peak is always a steady-state action's:

    - GPipe, LoopedBFS: all forwards of a stage, then all backwards: 3 (one between);
    - 1F1B, ZBVZeroBubble, DualPipeV: ``num_stages`` of warm-up, then steady pairs: the forwards
      between the first and last reach the steady state from ``num_stages + 2`` on;
    - Interleaved1F1B and InterleavedZeroBubble run microbatches in rounds of ``pp`` (counts past
      ``2 pp`` must be multiples of it): four rounds (three for the zero-bubble one, whose weight
      gradients come later) reach the steady state.

    Measured for pp 2 and 3, in the pattern above; the tests compare each schedule's extrapolation
    with its full run.
    """
    if schedule in ("GPipe", "LoopedBFS"):
        return 3, 1
    if schedule in ("1F1B", *V_SCHEDULES):
        return num_stages + 2, 1
    if schedule == "Interleaved1F1B":
        return 4 * pp, pp
    if schedule == "InterleavedZeroBubble":
        return 3 * pp, pp
    raise ValueError(f"no microbatch plan for schedule {schedule!r}")


def count_slope_at_one_depth(schedule: str) -> bool:
    """Whether what a microbatch adds is the same at every depth (no term in depth x count).

    1F1B bounds the microbatches in flight by the stage count and defers no weight gradient, so one
    more microbatch adds only its buffers (tested against the full run with both shortcuts).
    """
    return schedule == "1F1B"


def microbatch_plan(schedule: str, n: int, pp: int, num_stages: int, all_microbatches: bool) -> list[int]:
    """Pipeline microbatch counts to run: ``n``, or two smaller counts to extrapolate from.

    The two counts ``n1 < n2`` are ``step`` apart, past the point where each step adds the same
    memory, and ``n = n1 (mod step)``; they are used only when they cost less than ``n``.
    """
    first, step = affine_from(schedule, pp, num_stages)
    if all_microbatches or n % step:
        return [n]
    n1 = first + (n - first) % step
    n2 = n1 + step
    if n1 + n2 >= n:
        return [n]
    return [n1, n2]



@dataclass
class RunPlan:
    """The runs that stand for the full step, and notes saying which shortcuts they take."""

    depths: list[int]  # model depths: [n_layers], or two to extrapolate from
    microbatches: list[int]  # pipeline microbatch counts: [] without a pipeline, [n], or two
    pipeline_microbatches: int  # the step's own count (0 without a pipeline)
    # The larger count runs at the shallower depth only (see count_slope_at_one_depth).
    count_slope_at_one_depth: bool = False
    notes: list[str] = field(default_factory=list)
    # Names a peak's module in the full model from its names in the two shallow pipeline models.
    layer_names: Callable[[str, str], str] | None = None


def plan_runs(
    cfg: JobConfig, n_layers: int, pp: int, pp_rank: int, *, all_layers: bool, all_microbatches: bool,
    period: int | None = None,
) -> RunPlan:
    """Depths and pipeline microbatch counts to run for ``cfg``, seen from pipeline rank ``pp_rank``;
    ``period``: how blocks repeat (``block_period``; default: checkpointing's)."""
    period = period or ac_period(cfg)
    if pp == 1:
        depths = depth_plan(n_layers, period, all_layers)
        plan = RunPlan(depths, [], 0)
        if len(depths) == 2:
            plan.notes.append(
                f"{n_layers} layers extrapolated from models of {depths[0]} and {depths[1]} layers "
                "(exact: every block adds the same; --all-layers runs them all)"
            )
        return plan
    p = cfg.parallelism
    schedule = p.pipeline_parallel_schedule
    batch, size = cfg.training.local_batch_size, p.pipeline_parallel_microbatch_size
    if p.pipeline_parallel_schedule_csv:  # the file fixes the stages and the microbatch count
        return RunPlan([n_layers], [batch // size], batch // size)
    ranges = pipeline_layer_ranges(
        n_layers, pp, schedule, split_points=p.pipeline_parallel_split_points,
        layers_per_stage=p.pipeline_parallel_layers_per_stage,
    )
    num_stages = len(ranges)
    n = microbatch_count(batch, size, schedule, num_stages, pp)
    plan = RunPlan([n_layers], [n], n)
    # The warm-up lengths above hold for the schedules' own stage counts (1 or 2 per rank).
    if num_stages == pp * default_stages_per_rank(schedule):
        plan.microbatches = microbatch_plan(schedule, n, pp, num_stages, all_microbatches)
    if not (p.pipeline_parallel_split_points or p.pipeline_parallel_layers_per_stage):
        own = stage_ids_for_rank(pp_rank, pp, num_stages, "v" if schedule in V_SCHEDULES else "loop")
        plan.depths = pipeline_depth_plan(n_layers, period, num_stages, own, all_layers)
        if len(plan.depths) == 2:
            plan.layer_names = stage_layer_names(plan.depths, n_layers, num_stages)
            blocks = [sum(len(stage_layer_ranges(d, num_stages)[s]) for s in own) for d in plan.depths]
            plan.notes.append(
                f"{n_layers} layers extrapolated from models of {plan.depths[0]} and {plan.depths[1]} "
                f"layers, whose stages on this rank hold {blocks[0]} and {blocks[1]} layers instead of "
                f"{sum(len(ranges[s]) for s in own)} (exact: every block adds the same; --all-layers "
                "runs them all)"
            )
    if len(plan.microbatches) == 2:
        plan.count_slope_at_one_depth = count_slope_at_one_depth(schedule)
        plan.notes.append(
            f"{n} pipeline microbatches extrapolated from runs of {plan.microbatches[0]} and "
            f"{plan.microbatches[1]} (exact: past {schedule}'s warm-up every further microbatch adds the "
            "same; --all-microbatches runs them all)"
        )
    return plan


def runs_to_make(depths: list[int], microbatches: list[int], slope_at_one_depth: bool) -> list[tuple[int, int, int]]:
    """(depth, pipeline microbatch count, steps) of each run; count 0 without a pipeline.

    A pipeline's runs take two steps (its first also sets the stages up), others one. With two
    counts, the larger runs at both depths, or at the shallower only (``count_slope_at_one_depth``).
    """
    steps = 2 if microbatches else 1
    small, *large = microbatches or [0]
    runs = [(depth, small, steps) for depth in depths]
    if large and slope_at_one_depth:
        runs.append((depths[0], large[0], steps))
    elif large:
        runs += [(depth, large[0], steps) for depth in depths]
    return runs

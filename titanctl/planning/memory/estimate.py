"""Peak memory of one training step on one rank, estimated in one process without the hardware.

How: a fake process group (torch's backend "fake", whose collectives move no data) stands in for the
N-rank job as seen from rank 0, so the real ``ParallelDims`` mesh and the real ``build_model_parts``
build rank 0's sharded model parts (FSDP/HSDP, TP, CP, AC, pipeline stages), materialized inside a
``FakeTensorMode``: every tensor has its shape, dtype and device but no storage. Then the trainer's
own step code (``ForwardBackward``, ``clip_grad_norm``, the optimizer and LR schedule) runs under
torch's memory tracker (``FSDPMemTracker`` for FSDP layouts, ``MemTracker`` otherwise), which sees
every storage each op allocates or frees, sorted into parameters, gradients, optimizer state,
activations, temporaries and FSDP's communication buffers.

Four shortcuts keep a 405B model on 512 ranks under a minute, each exact by construction and
checked against the unshortened computation in the tests (``shortcuts`` says which runs to make):

- depth: every block runs the same code, so each quantity at each place of the step grows by the
  same amount per block; models of 4 and 5 blocks give it at 126, and under a pipeline, stages of
  3 and 4 blocks give it at 16 per stage (``shortcuts.depth_plan``, ``pipeline_depth_plan``);
- pipeline microbatches: past the schedule's warm-up, each further microbatch adds the same
  memory, so two counts give it at any count (``shortcuts.microbatch_plan``); with the depth
  shortcut, two depths by two counts give it at both, or for 1F1B (no term in depth x count)
  three runs, the larger count at the shallower depth only (``shortcuts.runs_to_make``);
- steps: the second step is the first with Adam's state alive from its start (``_steady_state``);
  a pipeline's second step (its first also sets the stages up) runs up to its first schedule action
  only, and each action's peak is the first step's plus what was alive then and not in the first
  step (``_second_pipeline_step``; under gradient accumulation it runs whole);
- gradient accumulation: at most two microbatches per step (the second already accumulates into
  existing gradients).

Each op of a run costs less than under torch's own classes, with the same result (tests): the fake
tensors' dispatch cache keys are built directly (``fake.FastKeyFakeTensorMode``) and the trackers
account each op in fewer steps (``tracker._StepPeaks.__torch_dispatch__``).

DDP is the one layout that is modelled rather than run: its C++ reducer reads tensor data, so it is
estimated as one replica plus its gradient buckets.

``validate`` runs two real steps on the current processes and measures rank 0's peak of each: on CPU
(gloo) from the CPU allocator's events (``torch.profiler``), on CUDA the caching allocator's own peak
(``torch.cuda.max_memory_allocated``, reset as each step starts), next to the tracker's view of the same
real run.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import math
import os
import re
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile, record_function

from titanctl import _torch_compat
from titanctl.config.job_config import JobConfig
from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from titanctl.errors import ConfigError, ParallelError
from titanctl.gc_pauses import automatic_gc_paused
from titanctl.models.common.moe import RoutedExperts
from titanctl.models.registry import get_spec, model_args_from_config, with_training_keys
from titanctl.models.shapes import num_params
from titanctl.parallel.converters.lora import is_adapter, saved_shapes
from titanctl.parallel.layouts.build import build_model_parts, check_layout
from titanctl.parallel.layouts.dims import ParallelDims
from titanctl.parallel.layouts.expert_parallel import balanced_routing
from titanctl.parallel.layouts.reductions import clip_grad_norm, global_mean_loss
from titanctl.parallel.runtime.env import init_process
from titanctl.planning.memory.fake import fake_tensor_mode
from titanctl.planning.memory.pipeline_peers import answer_for_fake_peers, is_schedule_action, label_actions
from titanctl.planning.memory.shortcuts import at_depth, block_period, plan_runs, runs_to_make
from titanctl.planning.memory.tracker import (
    DDP_BUCKETS,
    PHASES,
    FirstActionReached,
    NullTracker,
    Peak,
    anchor_layer,
    make_tracker,
    untracked_sharding_propagation,
)
from titanctl.train.loss import cross_entropy_sum
from titanctl.train.lr_schedule import build_lr_scheduler
from titanctl.train.optim import build_optimizer
from titanctl.train.step import ForwardBackward

# Llama 3's tokenizer: 128,000 BPE ranks + 256 special tokens.
LLAMA3_VOCAB_SIZE = 128_256
# Microbatches run per step: the second one already has gradients from the first, so a third
# would repeat it.
_MAX_MICROBATCHES = 2


@dataclass
class PhasePeak:
    step: int
    phase: str
    peak: int
    module: str


@dataclass
class MemoryEstimate:
    """What one rank holds at the peak of a training step (bytes)."""
    recipe: str
    model: str  # model.name: the family
    flavor: str
    world_size: int
    rank: int
    layout: str
    degrees: dict[str, int]
    target_device: str
    modelled_on: str
    vocab_size: int
    num_params: int
    seq_len: int
    local_batch_size: int
    grad_accum_steps: int
    pipeline_microbatches: int
    mixed_precision: str
    peak: int = 0
    peak_step: int = 0
    peak_phase: str = ""
    peak_module: str = ""
    categories: dict[str, int] = field(default_factory=dict)  # at the peak
    first_step_peak: int = 0
    phases: list[PhasePeak] = field(default_factory=list)
    parameter_bytes: int = 0  # this rank's parameters as stored (sharded, fp32)
    gradient_bytes: int = 0  # this rank's gradients after backward
    optimizer_state: dict[str, int] = field(default_factory=dict)  # after the first step, by state name
    ddp_bucket_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    layers_run: list[int] = field(default_factory=list)  # model depths run (two: extrapolated)
    microbatches_run: list[int] = field(default_factory=list)  # pipeline microbatch counts (two: extrapolated)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Validation:
    """A real step on the current processes, measured on rank 0."""
    world_size: int
    device: str
    tracked: dict[int, int]  # step -> peak seen by the tracker on real tensors
    # step -> peak of the tensors the training thread allocated (CPU: profiler; CUDA: max_memory_allocated)
    allocated: dict[int, int]
    allocated_process: dict[int, int]  # step -> the same, of every thread (+ gloo threads' buffers; CUDA: the same)
    estimated: dict[int, int]  # step -> the estimate's peak for that step

    @property
    def ratio(self) -> float:
        """Estimated / measured peak over both steps (measured: the training thread's allocations)."""
        return max(self.estimated.values()) / max(self.allocated.values())

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "ratio": self.ratio}


# ---------------------------------------------------------------------------------------------
# The recipe as it will be estimated


def estimation_config(cfg: JobConfig) -> tuple[JobConfig, list[str]]:
    """A copy of ``cfg`` without the features that need CUDA to build, and notes saying so."""
    cfg = copy.deepcopy(cfg)
    notes = []
    if cfg.compile.enable:
        cfg.compile.enable = False
        notes.append("compile.enable ignored: blocks are estimated in eager mode (compiled kernels may fuse "
                     "away some activations)")
    if cfg.parallelism.enable_async_tensor_parallel:
        cfg.parallelism.enable_async_tensor_parallel = False
        notes.append("async tensor parallel ignored (needs CUDA symmetric memory): TP is estimated "
                     "with ordinary collectives")
    f8 = cfg.float8
    if f8.enable_float8_linear:
        f8.enable_float8_linear = f8.enable_fsdp_float8_all_gather = False
        f8.precompute_float8_dynamic_scale_for_fsdp = False
        notes.append(f"float8 modelled as {cfg.training.mixed_precision_param}: float8 linears and float8 "
                     "all-gathers are not estimated (they would shrink all-gather buffers and saved inputs)")
    if cfg.activation_checkpoint.mode == "selective" and cfg.activation_checkpoint.selective_ac_option == "op":
        notes.append("op-level selective AC saves the CPU attention op here; on CUDA the flash/efficient "
                     "attention ops are saved the same way")
    return cfg, notes


def _published(cfg: JobConfig) -> bool:
    """A published size (run on GPUs), not a CPU-sized debug model."""
    return not cfg.model.flavor.startswith("debugmodel")


def resolve_vocab_size(cfg: JobConfig) -> tuple[int, str | None]:
    """The tokenizer's vocabulary, or, for the published flavors when their file is absent, the
    flavor's published one (Llama 3's tokenizer for Llama)."""
    path = Path(cfg.model.tokenizer_path or DEFAULT_TOKENIZER_PATH)
    if not path.is_file() and _published(cfg):
        published = get_spec(cfg.model.name).flavors[cfg.model.flavor].vocab_size
        vocab, whose = (published, f"{cfg.model.name} {cfg.model.flavor}'s") if published > 0 else (
            LLAMA3_VOCAB_SIZE, "Llama 3's")
        return vocab, f"tokenizer {path} not found: using {whose} vocabulary of {vocab:,} tokens"
    return Tokenizer(path).vocab_size, None


def target_device(cfg: JobConfig, requested: str) -> str:
    """The device the recipe is for: the flagship flavors and CUDA-only features mean GPUs."""
    if requested != "auto":
        return requested
    p, f8 = cfg.parallelism, cfg.float8
    if _published(cfg) or p.enable_async_tensor_parallel or f8.enable_float8_linear:
        return "cuda"
    return "cpu"


def grad_accum_steps(cfg: JobConfig, dp: int) -> int:
    t = cfg.training
    per_microbatch = t.local_batch_size * dp
    global_batch = per_microbatch if t.global_batch_size == -1 else t.global_batch_size
    if global_batch % per_microbatch:
        raise ConfigError(
            f"training.global_batch_size={global_batch} must be a positive multiple of local_batch_size x "
            f"data-parallel degree = {t.local_batch_size} x {dp} = {per_microbatch}"
        )
    return global_batch // per_microbatch


# ---------------------------------------------------------------------------------------------
# The step, shared by the estimate (fake tensors) and the validation (real ones)


@dataclass
class _Run:
    peaks: dict  # (step, phase, anchor) -> Peak
    start: dict[str, int]  # bytes per category before the first step
    after_backward: dict[str, int]  # bytes per category after the first step's backward
    optimizer_state: dict[str, int]  # bytes per optimizer state name after the first step
    pipeline_microbatches: int
    steps: int
    second_step_derived: bool = False  # see _second_pipeline_step


def _local_bytes(t) -> int:

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def _run_steps(
    cfg: JobConfig, dims, args, device, *, accum: int, steps: int, period: int, fake_mode=None, marker=None,
    track: bool = True, derive_second_step: bool = False,
) -> _Run:
    """Build this rank's model parts and run ``steps`` training steps under a memory tracker.

    With ``fake_mode`` everything happens on fake tensors; without, on real ones. ``marker(step)``
    returns a context wrapped around each step (profiler ranges for validation). ``track=False``
    runs the same steps untracked (the ranks of a validation that measure nothing).
    ``derive_second_step``: a pipeline's second step runs only up to its first schedule action,
    the rest is derived from the first step's (``_second_pipeline_step``).
    """
    fake = fake_mode is not None
    built = build_model_parts(
        cfg, dims, args, device, loss_fn=cross_entropy_sum, init=not fake, fake_mode=fake_mode
    )
    if fake:
        for part in built.parts:
            for module in part.modules():
                if isinstance(module, RoutedExperts):
                    module.grouped_mm = _ShapeOnlyGroupedMM.apply
    if built.pipeline is not None and fake:

        answer_for_fake_peers(built.pipeline)
    with fake_mode if fake else contextlib.nullcontext():
        optimizer = build_optimizer(built.parts, cfg.optimizer)
        lr_scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps)
        # A document mask's shapes, not where its documents fall, set the step's memory (the masked ring sends
        # every block of fake tensors, the most it can): any token id marks documents among the random ids.
        bos_id = None if cfg.model.attn_mask_type == "causal" else 0
        forward_backward = ForwardBackward(cfg, dims, built.parts, built.pipeline, device, bos_id=bos_id)
        shape = (cfg.training.local_batch_size, cfg.training.seq_len)
        generator = None if fake else torch.Generator().manual_seed(cfg.training.seed)

        def batch() -> list[tuple[torch.Tensor, torch.Tensor]]:
            """A step's microbatches of token ids (fresh ones: context parallel shards them in place)."""
            # Drawn on the CPU (the generator's device), then moved: the same ids on every device.
            return [
                tuple(torch.randint(0, args.vocab_size, shape, generator=generator).to(device) for _ in "xy")
                for _ in range(min(accum, _MAX_MICROBATCHES))
            ]

        params = [p for part in built.parts for p in part.parameters()]
        microbatches = batch()
        if track:
            tracker = make_tracker(
                built.parts, optimizer, [t for mb in microbatches for t in mb],
                fsdp=dims.fsdp_enabled, n_layers=args.n_layers, period=period,
            )
            if built.pipeline is not None:

                label_actions(built.pipeline, tracker)
        else:
            tracker = NullTracker()
        pipeline_microbatches = built.pipeline.n_microbatches if built.pipeline else 0
        run = _Run({}, {}, {}, {}, pipeline_microbatches, steps)
        with tracker, automatic_gc_paused(), balanced_routing() if fake else contextlib.nullcontext():
            run.start = tracker.current()
            for step in range(1, steps + 1):
                tracker.step = step
                if step == 2 and derive_second_step and _second_step_derivable(built.pipeline, accum, tracker):
                    tracker.stop_at_first_action = 2
                if step > 1:
                    microbatches = batch()
                    tracker.track_step_inputs([t for mb in microbatches for t in mb])
                # Collect reference cycles left by the previous step, as the trainer does every
                # training.gc_freq steps: a young-generation collection, which reaches everything made
                # since the last one (nothing is promoted while collection is paused), without
                # walking the whole heap (a second or so with torch's modules loaded).
                gc.collect(1)
                with marker(step) if marker else contextlib.nullcontext():
                    # The trainer's step (Trainer.train_step), less data loading and logging.
                    tracker.phase = "forward"
                    try:
                        loss = forward_backward(microbatches)
                    except FirstActionReached:
                        _second_pipeline_step(tracker, sum(run.optimizer_state.values()))
                        run.second_step_derived = True
                        break
                    if step == 1:
                        run.after_backward = tracker.current()
                    tracker.phase = "clip_grad_norm"
                    clip_grad_norm(params, cfg.training.max_norm, dims)
                    global_mean_loss(loss, dims)
                    tracker.phase = "optimizer step"
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                    del loss
                if step == 1:
                    for state in optimizer.state.values():
                        for name, value in state.items():
                            if isinstance(value, torch.Tensor):
                                run.optimizer_state[name] = run.optimizer_state.get(name, 0) + _local_bytes(value)
                tracker.next_step()
        run.peaks = dict(tracker.peaks)
    return run


def _second_step_derivable(pipeline, accum: int, tracker) -> bool:
    """Whether step 2 can be derived from step 1 (``_second_pipeline_step``): a pipeline whose
    schedule runs once per step (with gradient accumulation, the second run frees what the set-up
    left alive in the first, so that the first step's actions do not all find the same state), and
    whose stages were all set up before the step's first action."""
    return pipeline is not None and accum == 1 and not tracker.set_up_after_action


def _second_pipeline_step(tracker, optimizer_state: int) -> None:
    """Step 2 of a pipeline from step 1's schedule actions, and its own start up to its first action.

    From its first action on, step 2 runs the same actions as step 1, on the same model, with the
    same message buffers (set up by step 1 before its first action): what each of its ops finds
    alive differs from step 1 only by what was alive when the step's first action began
    (``tracker.action_start``): Adam's state, and what the first step's set-up left and the
    previous step's schedule still holds. So each action's peak is step 1's plus that difference,
    less Adam's state in the optimizer step, which step 1 creates at its start (as
    ``_steady_state``). What step 2 does before its first action (new inputs, splitting them into
    microbatches) was run (``tracker.stop_at_first_action``). Checked against running step 2, for
    every schedule, in the tests.
    """
    first, second = tracker.action_start[1], tracker.action_start[2]
    shift = {category: second.get(category, 0) - first.get(category, 0) for category in first.keys() | second.keys()}
    for (step, phase, anchor), peak in list(tracker.peaks.items()):
        if step != 1 or not is_schedule_action(anchor.partition("@")[2]):
            continue
        categories = {category: value + shift.get(category, 0) for category, value in peak.categories.items()}
        if phase == "optimizer step":
            categories["optimizer state"] -= optimizer_state
        tracker.peaks[(2, phase, anchor)] = Peak(sum(categories.values()), categories, peak.module)


class _ShapeOnlyGroupedMM(torch.autograd.Function):
    """``torch._grouped_mm``'s outputs and gradients as shapes only: torch 2.13 has no fake kernel
    of it for float32, and on fake tensors the group sizes are unknown anyway. It allocates what
    the real op does: the (M, N) output, and in backward one gradient per input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x.new_empty(x.shape[0], w.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w), None


def _extrapolate(small: _Run, large: _Run, x1: int, x2: int, x: int, onto: _Run | None = None) -> _Run:
    """Each quantity at size ``x`` from its values at sizes ``x1`` and ``x2`` (it is affine in size).

    Sizes are model depths or pipeline microbatch counts; ``x = x1 (mod x2 - x1)`` by the plans'
    choice, so everything stays in whole bytes. ``onto``: a run at size ``x1`` of another model, to
    which the growth measured between ``small`` and ``large`` is added (the same in both models).
    """
    k = (x - x1) // (x2 - x1)
    base = onto or small

    def line(start: dict, a: dict, b: dict) -> dict:
        return {key: start[key] + (b.get(key, 0) - a[key]) * k for key in start}

    peaks = {}
    for key, peak in base.peaks.items():
        pa, pb = small.peaks.get(key), large.peaks.get(key)
        if pa is not None and pb is not None:  # places present at both sizes; see shortcuts.depth_plan
            categories = line(peak.categories, pa.categories, pb.categories)
            peaks[key] = Peak(sum(categories.values()), categories, peak.module if onto else pb.module)
    return _Run(
        peaks,
        line(base.start, small.start, large.start),
        line(base.after_backward, small.after_backward, large.after_backward),
        line(base.optimizer_state, small.optimizer_state, large.optimizer_state),
        large.pipeline_microbatches,
        base.steps,
    )


def _combine(runs: dict[tuple[int, int], _Run], plan: Plan) -> _Run:
    """The full step from the runs of the plan (``shortcuts.runs_to_make``).

    Memory is affine in depth at a fixed count and in the count at a fixed depth, with a term in
    their product for some schedules (GPipe keeps every microbatch's activations of every block):
    extrapolating in depth at both counts, then in the count, is exact for such a function. Without
    the product term, the growth per microbatch measured on the shallower model is added to the
    full depth at the smaller count.
    """
    depths, n_layers, n_microbatches = plan.depths, plan.args.n_layers, plan.pipeline_microbatches
    counts = plan.microbatches or [0]

    def full_depth(count: int) -> _Run:
        if len(depths) == 1:
            return runs[depths[0], count]
        small, large = runs[depths[0], count], runs[depths[1], count]
        run = _extrapolate(small, large, *depths, n_layers)
        if plan.layer_names is not None:
            for key, peak in run.peaks.items():
                peak.module = plan.layer_names(small.peaks[key].module, large.peaks[key].module)
        return run

    if len(counts) == 1:
        return full_depth(counts[0])
    if plan.count_slope_at_one_depth:
        shallow = depths[0]
        run = _extrapolate(runs[shallow, counts[0]], runs[shallow, counts[1]], *counts, n_microbatches,
                           onto=full_depth(counts[0]))
    else:
        run = _extrapolate(full_depth(counts[0]), full_depth(counts[1]), *counts, n_microbatches)
    run.pipeline_microbatches = n_microbatches
    return run


def _steady_state(run: _Run) -> None:
    """Add step 2 to a run of one step: the same step with Adam's state present from its start.

    Step 2 differs from step 1 only by the optimizer state, created during step 1's optimizer step
    and alive from then on (checked against a second step run for real, in the tests).
    """
    extra = sum(run.optimizer_state.values())
    for (step, phase, anchor), peak in list(run.peaks.items()):
        if step != 1:
            continue
        categories = dict(peak.categories)
        if phase != "optimizer step":
            categories["optimizer state"] += extra
        run.peaks[(2, phase, anchor)] = Peak(sum(categories.values()), categories, peak.module)
    run.steps = 2


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int):
    """The default process group is a fake one of ``world_size`` ranks, seen from ``rank``."""
    if dist.is_initialized():
        raise RuntimeError("a process group already exists: estimate before starting the real one")
    # No store: for backend "fake" torch makes its own (a FakeStore) when none is given.
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass
class Plan:
    """A checked request: the recipe as estimated, its layout and model, and what to run."""
    cfg: JobConfig  # without compile / async TP (see estimation_config)
    recipe: str
    world_size: int
    rank: int
    target: str
    notes: list[str]
    vocab_size: int
    dims: object  # ParallelDims
    args: object  # ModelArgs
    accum: int
    period: int
    depths: list[int]  # model depths to run (two: extrapolated)
    microbatches: list[int]  # pipeline microbatch counts to run ([] without a pipeline; two: extrapolated)
    pipeline_microbatches: int
    layer_names: object = None  # pipelines run shallower: see shortcuts.stage_layer_names
    count_slope_at_one_depth: bool = False  # see shortcuts.count_slope_at_one_depth
    derive_second_step: bool = True  # a pipeline's second step from its first (see _second_pipeline_step)


def plan_estimate(
    cfg: JobConfig,
    world_size: int,
    *,
    rank: int = 0,
    device: str = "auto",
    recipe: str = "",
    all_layers: bool = False,
    all_microbatches: bool = False,
) -> Plan:
    """Check everything that can be wrong with the request, without starting anything."""
    if world_size < 1:
        raise ParallelError(f"--world-size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ParallelError(f"rank {rank} is out of range for world size {world_size}")
    if device not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"--device {device!r} is not one of auto, cuda, cpu")

    target = target_device(cfg, device)
    if cfg.model.attn_mask_type != "causal" and target != "cpu":
        # On CUDA the document mask is a FlexAttention block mask run by a compiled kernel, which fake tensors do
        # not run as compiled; on CPU the step's dense bool masks and kernels are what runs.
        raise ConfigError(
            f"estimate-memory models model.attn_mask_type = {cfg.model.attn_mask_type} on --device cpu only (CUDA's "
            "compiled FlexAttention is not modelled): estimate with --device cpu, or with causal"
        )
    cfg, notes = estimation_config(cfg)
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    accum = grad_accum_steps(cfg, dims.dp)


    vocab, vocab_note = resolve_vocab_size(cfg)
    if vocab_note:
        notes.insert(0, vocab_note)
    args = with_training_keys(model_args_from_config(cfg.model, vocab, cfg.training.seq_len), cfg.model)
    check_layout(cfg, dims, args)
    if args.moe is not None:
        notes.append(
            "Mixture of Experts: routing is taken as balanced (every expert gets top_k x tokens / experts "
            "tokens; fake tensors have no values to route by): a skewed router makes the busiest "
            "experts' activations and, under expert parallelism, the dispatch buffers larger"
        )
    if cfg.lora.enable:
        adapters = sum(math.prod(shape) for name, shape in saved_shapes(args, cfg.lora).items() if is_adapter(name))
        notes.append(
            f"LoRA: {adapters / 1e6:.3g}M adapter parameters train; the frozen base's {num_params(args) / 1e6:.4g}M "
            "parameters are held (in fp32, sharded as the layout shards them) without gradients or optimizer state"
        )
    if dims.ddp_enabled:
        notes.append(
            "DDP: estimated as one replica plus DDP's gradient buckets (a copy of the fp32 gradients, "
            "gradient_as_bucket_view off); DDP's reducer cannot run on fake tensors"
        )
    if target == "cuda":
        notes.append(
            "estimated on fake CPU tensors (a CPU-only torch cannot run autograd on fake CUDA tensors): "
            "the CUDA caching allocator's rounding and fragmentation, the CUDA context, NCCL and cuBLAS "
            "workspaces (typically 1-3 GiB per GPU together) are not included"
        )
    if target == "cpu" and dims.fsdp_enabled:
        notes.append(
            "on CPU, gloo runs each FSDP reduce-scatter as an all-reduce on a full-size copy of the "
            "gradients of one FSDP group, made inside the backend and not estimated: a real run may hold "
            "up to one more such copy (NCCL does not make it)"
        )
    if accum > _MAX_MICROBATCHES:
        notes.append(f"gradient accumulation: {_MAX_MICROBATCHES} of {accum} microbatches run "
                     "(later ones repeat the second)")
    pp_rank = rank // (world_size // dims.pp)  # pp is the outermost mesh dimension
    period = block_period(cfg, args.layer_types, args.n_layers)
    runs = plan_runs(cfg, args.n_layers, dims.pp, pp_rank, all_layers=all_layers, all_microbatches=all_microbatches,
                     period=period)
    notes.extend(runs.notes)
    return Plan(
        cfg, recipe, world_size, rank, target, notes, vocab, dims, args, accum, period, runs.depths,
        runs.microbatches, runs.pipeline_microbatches, runs.layer_names, runs.count_slope_at_one_depth,
    )


def estimate_memory(cfg: JobConfig, world_size: int, **kwargs) -> MemoryEstimate:
    """Estimate rank 0's (or ``rank``'s) peak memory for a training step of ``cfg`` on ``world_size`` ranks."""
    return run_estimate(plan_estimate(cfg, world_size, **kwargs))


def run_estimate(plan: Plan) -> MemoryEstimate:
    started = time.perf_counter()


    dims, args, cfg = plan.dims, plan.args, plan.cfg
    run_dims = dataclasses.replace(dims)  # its own mesh, on the fake process group
    if dims.ddp_enabled:
        # DDP's C++ reducer reads tensor data, which fake tensors have not: estimate one replica
        # (the whole model on one rank) and add DDP's gradient buckets.
        run_dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, world_size=1)
    result = MemoryEstimate(
        recipe=plan.recipe,
        model=cfg.model.name,
        flavor=cfg.model.flavor,
        world_size=plan.world_size,
        rank=plan.rank,
        layout=dims.describe(),
        degrees=dims.degrees,
        target_device=plan.target,
        modelled_on="fake CPU tensors on a fake process group",
        vocab_size=plan.vocab_size,
        num_params=num_params(args),
        seq_len=cfg.training.seq_len,
        local_batch_size=cfg.training.local_batch_size,
        grad_accum_steps=plan.accum,
        pipeline_microbatches=0,
        mixed_precision=cfg.training.mixed_precision_param,
        notes=list(plan.notes),
        layers_run=list(plan.depths),
        microbatches_run=list(plan.microbatches),
    )
    cpu = torch.device("cpu")
    runs = {}
    with fake_process_group(plan.world_size, plan.rank):
        run_dims.mesh  # noqa: B018 (built from real index tensors, before fake mode)
        with untracked_sharding_propagation():
            for n_layers, count, steps in runs_to_make(plan.depths, plan.microbatches, plan.count_slope_at_one_depth):
                run_cfg = _with_pipeline_microbatches(cfg, count) if count else cfg
                runs[n_layers, count] = _run_steps(
                    run_cfg, run_dims, at_depth(args, n_layers), cpu, accum=plan.accum, steps=steps,
                    period=plan.period, fake_mode=fake_tensor_mode(allow_non_fake_inputs=True),
                    derive_second_step=plan.derive_second_step,
                )
    run = _combine(runs, plan)
    if run.steps == 1:
        _steady_state(run)
    if dims.ddp_enabled:
        result.ddp_bucket_bytes = run.start["parameters"]
        for peak in run.peaks.values():
            peak.categories[DDP_BUCKETS] += result.ddp_bucket_bytes
            peak.total += result.ddp_bucket_bytes
    # Pipelines' shallow models name their peaks' modules at full depth already (plan.layer_names).
    _fill(result, run, args.n_layers, plan.period, extrapolated=len(plan.depths) == 2 and plan.layer_names is None)
    result.seconds = time.perf_counter() - started
    return result


def _with_pipeline_microbatches(cfg: JobConfig, count: int) -> JobConfig:
    """``cfg`` with a local batch of ``count`` pipeline microbatches of the same size."""
    cfg = copy.deepcopy(cfg)
    cfg.training.local_batch_size = count * cfg.parallelism.pipeline_parallel_microbatch_size
    return cfg


def _fill(result: MemoryEstimate, run: _Run, n_layers: int, period: int, extrapolated: bool) -> None:

    def module(anchor: str, name: str) -> str:
        if not extrapolated:
            return name
        match = re.match(r"layers\.<([^>]+)>", anchor)
        if not match:
            return name
        # The run's own layer id -> the one this place has at the full depth.
        return re.sub(r"^layers\.\d+", f"layers.{anchor_layer(match.group(1), n_layers, period)}", name)

    best: dict[tuple[int, str], tuple] = {}
    for (step, phase, anchor), peak in run.peaks.items():
        if (step, phase) not in best or peak.total > best[(step, phase)][1].total:
            best[(step, phase)] = (anchor, peak)
    order = {phase: i for i, phase in enumerate(PHASES)}
    result.phases = [
        PhasePeak(step, phase, peak.total, module(anchor, peak.module))
        for (step, phase), (anchor, peak) in sorted(best.items(), key=lambda kv: (kv[0][0], order[kv[0][1]]))
    ]
    (step, phase), (anchor, top) = max(best.items(), key=lambda kv: kv[1][1].total)
    result.peak, result.peak_step, result.peak_phase = top.total, step, phase
    result.peak_module = module(anchor, top.module)
    result.categories = dict(top.categories)
    result.first_step_peak = max(p.peak for p in result.phases if p.step == 1)
    result.parameter_bytes = run.start.get("parameters", 0)
    result.gradient_bytes = run.after_backward.get("gradients", 0)
    result.optimizer_state = dict(run.optimizer_state)
    result.pipeline_microbatches = run.pipeline_microbatches


def step_peaks(estimate: MemoryEstimate) -> dict[int, int]:
    out: dict[int, int] = {}
    for p in estimate.phases:
        out[p.step] = max(out.get(p.step, 0), p.peak)
    return out


# ---------------------------------------------------------------------------------------------
# Validation: the real step on the current processes


def validate(plan: Plan, estimate: MemoryEstimate | None) -> Validation | None:
    """Run the two steps for real (CPU processes on gloo, or GPUs; alone or under torchrun) and
    measure rank 0's peaks.

    Every rank runs the step; rank 0 returns the measurement, the others None.
    """
    check_validation_world(plan.world_size)
    cfg, args = plan.cfg, plan.args
    dims = dataclasses.replace(plan.dims)  # its own mesh, on the real process group
    env = init_process(cfg.comm.init_timeout_seconds)
    torch.manual_seed(cfg.training.seed)

    def marker(step):
        return record_function(f"titanctl-memory-step-{step}")

    if env.rank != 0:  # the other ranks take part in the collectives; rank 0 measures
        _run_steps(cfg, dims, args, env.device, accum=plan.accum, steps=2, period=plan.period, track=False)
        return None
    if env.device.type == "cuda":
        peaks: dict[int, int] = {}
        run = _run_steps(cfg, dims, args, env.device, accum=plan.accum, steps=2, period=plan.period,
                         marker=cuda_step_peaks(env.device, peaks))
        return Validation(env.world_size, str(env.device), _tracked_peaks(run), peaks, dict(peaks),
                          step_peaks(estimate) if estimate is not None else {})
    # Profile from before the model exists, so that the allocator's count covers every live tensor.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run = _run_steps(cfg, dims, args, env.device, accum=plan.accum, steps=2, period=plan.period, marker=marker)
    thread, process = _allocator_peaks(prof)
    return Validation(
        world_size=env.world_size,
        device=str(env.device),
        tracked=_tracked_peaks(run),
        allocated=thread,
        allocated_process=process,
        estimated=step_peaks(estimate) if estimate is not None else {},
    )


def _tracked_peaks(run: _Run) -> dict[int, int]:
    tracked: dict[int, int] = {}
    for (step, _, _), peak in run.peaks.items():
        tracked[step] = max(tracked.get(step, 0), peak.total)
    return tracked


def cuda_step_peaks(device: torch.device, peaks: dict[int, int], cuda=torch.cuda):
    """A step marker for :func:`_run_steps` on CUDA: each step's peak of allocated bytes, what was
    alive when it began included (the caching allocator's peak, reset at the step's start), into
    ``peaks``. ``cuda`` stands in for ``torch.cuda`` in tests."""

    @contextlib.contextmanager
    def marker(step: int):
        cuda.synchronize(device)
        cuda.reset_peak_memory_stats(device)
        yield
        cuda.synchronize(device)  # the step's kernels have run, and freed what they freed
        peaks[step] = cuda.max_memory_allocated(device)

    return marker


def check_validation_world(world_size: int) -> None:
    """--validate runs on the processes that exist: their number must be the requested world size."""
    started = int(os.environ.get("WORLD_SIZE", "1"))
    if started != world_size:
        raise ParallelError(
            f"--validate runs the real step on the current processes: --world-size is {world_size} but "
            f"{started} process(es) were started (torchrun --nproc_per_node {world_size} ...)"
        )


def _allocator_peaks(prof) -> tuple[dict[int, int], dict[int, int]]:
    """Per step: the most bytes of CPU memory handed out and not yet taken back, at once.

    Two counts, from ``torch.profiler``'s allocation and free events: (1) the blocks the training
    thread allocated (every tensor of the step); (2) those of every thread, i.e. also the buffers that
    gloo's worker threads allocate for the collectives they run (CPU backend scratch space that NCCL
    does not take from PyTorch's allocator, and whose amount depends on thread timing).

    Some frees reach no profiler: those on a thread where profiling is off, e.g. where a gloo thread
    drops the last reference to a tensor of the training thread. The allocator's own running total
    (``total_allocated``) keeps such a block forever, so it grows with every unseen free, by an
    amount that depends on thread timing. Here an address handed out again ends its earlier block,
    which the allocator cannot have handed out twice; a block freed unseen whose address is not
    reused stays counted, so the measurement can only err high.
    """
    allocation = _torch_compat.PROFILER_ALLOCATION_EVENT.get()
    windows: dict[int, tuple[int, int]] = {}
    training_thread = None
    events: list[tuple[int, int, int, int]] = []  # (time, size (+ allocated, - freed), address, thread)
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.alloc_size, fields.ptr, node.start_tid))
        elif node.name.startswith("titanctl-memory-step-"):
            windows[int(node.name.rsplit("-", 1)[1])] = (node.start_time_ns, node.end_time_ns)
            training_thread = node.start_tid
    return peaks_per_step(events, windows, training_thread)


def peaks_per_step(
    events: list[tuple[int, int, int, int]], windows: dict[int, tuple[int, int]], training_thread: int | None
) -> tuple[dict[int, int], dict[int, int]]:
    """The two counts of :func:`_allocator_peaks` from its events (time, size: + allocated, - freed,
    address, thread) and each step's (begin, end) time."""
    thread_blocks, process_blocks = _LiveBlocks(), _LiveBlocks()
    timeline = []  # (time, training thread's live bytes, every thread's)
    for t, size, ptr, tid in sorted(events, key=lambda e: e[0]):
        if size > 0:
            process_blocks.allocate(ptr, size)
            if tid == training_thread:
                thread_blocks.allocate(ptr, size)
            else:
                thread_blocks.free(ptr)  # a reused address: the training thread's block there is gone
        else:
            process_blocks.free(ptr)
            thread_blocks.free(ptr)  # wherever the last reference dropped
        timeline.append((t, thread_blocks.total, process_blocks.total))
    thread, process = {}, {}
    for step, (begin, end) in windows.items():
        before = [e for e in timeline if e[0] < begin][-1:]
        inside = before + [e for e in timeline if begin <= e[0] <= end]
        thread[step] = max(e[1] for e in inside)
        process[step] = max(e[2] for e in inside)
    return thread, process


class _LiveBlocks:
    """Blocks handed out and not yet taken back, by address."""

    def __init__(self):
        self.sizes: dict[int, int] = {}
        self.total = 0

    def allocate(self, ptr: int, size: int) -> None:
        self.free(ptr)  # its earlier block was freed where no profiler saw it
        self.sizes[ptr] = size
        self.total += size

    def free(self, ptr: int) -> None:
        self.total -= self.sizes.pop(ptr, 0)


def rss_peak_bytes() -> int:
    """This process's peak resident set size (Linux VmHWM)."""
    try:
        for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

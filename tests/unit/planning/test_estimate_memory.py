"""`titanctl estimate-memory` in one process: fake tensors, a fake process group, exact bookkeeping."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from tests.cli_server import titanctl_run
from tests.conftest import REPO
from titanctl.config.recipe import load_config
from titanctl.models.llama.args import LLAMA3_FLAVORS
from titanctl.models.shapes import num_params
from titanctl.parallel.layouts.pipeline_stages import SCHEDULES, SINGLE_STAGE_SCHEDULES
from titanctl.planning.memory import estimate as memory
from titanctl.planning.memory import shortcuts

TINY = ["--model.n_layers", "2", "--training.seq_len", "64"]


@pytest.fixture(autouse=True)
def no_process_group():
    assert not dist.is_initialized(), "another test left a process group behind"
    yield
    assert not dist.is_initialized(), "the estimate left its fake process group behind"


def estimate(recipe: str, world_size: int, overrides: list[str], **kwargs) -> memory.MemoryEstimate:
    return memory.estimate_memory(load_config(REPO / recipe, overrides), world_size, **kwargs)


@pytest.mark.slow
def test_405b_on_512_ranks_is_plausible():
    """The flagship estimate's numbers (its time is no test's business: a few seconds, see
    docs/memory-and-planning.md; benchmarks/estimate_memory_time.py times the pipelined one)."""
    e = estimate("recipes/llama3_405b.toml", 512, [])
    assert e.layout == "dp_shard 64 x tp 8" and e.vocab_size == 128_256 and e.layers_run == [4, 5]
    assert e.target_device == "cuda"
    assert any("128,256" in note for note in e.notes) and any("float8" in note for note in e.notes)
    # fp32 parameters sharded over all 512 ranks (FSDP 64 x TP 8), as stored; Adam's two moments alike.
    per_rank = e.num_params * 4 / 512
    assert e.parameter_bytes == pytest.approx(per_rank, rel=0.01)
    assert e.optimizer_state["exp_avg"] == e.optimizer_state["exp_avg_sq"] == pytest.approx(per_rank, rel=0.01)
    assert e.gradient_bytes == pytest.approx(per_rank, rel=0.01)
    # The steady-state peak holds parameters, Adam's state and full-AC activations: 4-80 GiB.
    assert 4 * per_rank < e.peak < 80 * 2**30
    assert e.peak == sum(e.categories.values())
    assert e.peak_step == 2 and e.peak > e.first_step_peak
    # With full AC each block keeps only its input: (2, 8192 / tp 8, 16384) bf16 = 64 MiB per block.
    assert e.categories["activations"] > 126 * 64 * 2**20


@pytest.mark.slow
def test_8b_fsdp_parameters_gradients_and_adam_state_are_analytic():
    e = estimate("recipes/llama3_8b.toml", 8, ["--training.seq_len", "256"])
    n = num_params(LLAMA3_FLAVORS["8B"].replace(vocab_size=128_256))
    assert e.layout == "dp_shard 8"
    assert e.parameter_bytes == n * 4 // 8  # every dim of the 8B model divides by 8: no padding
    assert e.gradient_bytes == n * 4 // 8
    assert e.optimizer_state["exp_avg"] == e.optimizer_state["exp_avg_sq"] == n * 4 // 8
    assert e.categories["parameters"] == n * 4 // 8
    assert e.categories["optimizer state"] == 2 * n * 4 // 8 + e.optimizer_state["step"]


@pytest.mark.slow
def test_deep_models_extrapolate_exactly():
    """Ten blocks from runs of four and five equal running all ten, byte for byte (FSDP x TP, full AC, bf16)."""
    args = ["--model.n_layers", "10", "--training.seq_len", "64", "--parallelism.tensor_parallel_degree", "2",
            "--activation_checkpoint.mode", "full", "--training.mixed_precision_param", "bfloat16"]
    fast = estimate("recipes/llama3_debug.toml", 4, args)
    full = estimate("recipes/llama3_debug.toml", 4, args, all_layers=True)
    assert fast.layers_run == [4, 5] and full.layers_run == [10]
    assert [(p.step, p.phase, p.peak, p.module) for p in fast.phases] == [
        (p.step, p.phase, p.peak, p.module) for p in full.phases
    ]
    assert fast.categories == full.categories
    assert (fast.parameter_bytes, fast.gradient_bytes, fast.optimizer_state) == (
        full.parameter_bytes, full.gradient_bytes, full.optimizer_state
    )


@pytest.mark.slow
def test_second_step_equals_the_first_plus_adam_state():
    """The estimate runs one step and derives the second; running the second step agrees."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titanctl.planning.memory.tracker import untracked_sharding_propagation

    plan = memory.plan_estimate(load_config(REPO / "recipes/llama3_debug.toml", TINY), 2)
    runs = {}
    with memory.fake_process_group(2, 0):
        plan.dims.mesh  # noqa: B018
        with untracked_sharding_propagation():
            for steps in (1, 2):
                runs[steps] = memory._run_steps(
                    plan.cfg, plan.dims, plan.args, torch.device("cpu"), accum=1, steps=steps, period=1,
                    fake_mode=FakeTensorMode(allow_non_fake_inputs=True),
                )
    memory._steady_state(runs[1])
    assert {k: v.total for k, v in runs[1].peaks.items()} == {k: v.total for k, v in runs[2].peaks.items()}


@pytest.mark.slow
def test_lora_holds_the_frozen_base_without_gradients_or_adam_state_as_measured():
    """A LoRA run's estimate holds every base parameter, gradients and Adam's moments for the adapters
    only, and agrees with the real step's peak (in process: --validate's measurement, one process)."""
    import math

    from titanctl.parallel.converters.lora import is_adapter, saved_shapes

    common = [*TINY, "--training.mixed_precision_param", "float32", "--activation_checkpoint.mode", "none"]
    lora = ["--lora.enable", "--lora.rank", "8", "--lora.target_modules", "attention,feed_forward"]
    cfg = load_config(REPO / "recipes/llama3_debug.toml", [*common, *lora])
    plan = memory.plan_estimate(cfg, 1)
    e = memory.run_estimate(plan)
    adapters = sum(math.prod(s) for n, s in saved_shapes(plan.args, cfg.lora).items() if is_adapter(n))
    assert 0 < adapters < e.num_params / 20
    assert e.parameter_bytes == 4 * (e.num_params + adapters)
    assert e.gradient_bytes == 4 * adapters
    assert e.optimizer_state["exp_avg"] == e.optimizer_state["exp_avg_sq"] == 4 * adapters
    assert any("frozen base" in note for note in e.notes)
    full = memory.run_estimate(memory.plan_estimate(load_config(REPO / "recipes/llama3_debug.toml", common), 1))
    assert full.peak - e.peak > 0.5 * 12 * e.num_params  # no fp32 gradient, exp_avg, exp_avg_sq of the base
    measured = memory.validate(plan, e)
    ratios = {step: measured.estimated[step] / measured.allocated[step] for step in (1, 2)}
    print(f"\nLORA estimate {e.peak / 2**20:.1f} MiB (full fine-tuning {full.peak / 2**20:.1f} MiB), measured "
          f"{ {s: round(measured.allocated[s] / 2**20, 1) for s in (1, 2)} } MiB: ratios {ratios}")
    assert all(abs(r - 1) <= 0.15 for r in ratios.values()), ratios


def test_ddp_is_one_replica_plus_gradient_buckets():
    overrides = [*TINY, "--parallelism.data_parallel_replicate_degree", "2",
                 "--parallelism.data_parallel_shard_degree", "1"]
    ddp = estimate("recipes/llama3_debug.toml", 2, overrides)
    single = estimate("recipes/llama3_debug.toml", 1, TINY)
    assert ddp.ddp_bucket_bytes == single.parameter_bytes == ddp.parameter_bytes
    assert ddp.peak == single.peak + ddp.ddp_bucket_bytes
    assert any("DDP" in note for note in ddp.notes)


@pytest.mark.slow
def test_pipeline_rank0_estimate_runs_its_stages():
    e = estimate("recipes/llama3_debug.toml", 2, [
        *TINY, "--model.n_layers", "4", "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
        "--parallelism.pipeline_parallel_microbatch_size", "2",
    ])
    assert e.layout == "pp 2" and e.pipeline_microbatches == 4
    single = estimate("recipes/llama3_debug.toml", 1, [*TINY, "--model.n_layers", "4"])
    assert e.parameter_bytes < single.parameter_bytes  # rank 0 holds stages 0 and 2 of 4


def pipeline_overrides(schedule: str, n_layers: int, microbatches: int) -> list[str]:
    return [
        "--model.n_layers", str(n_layers), "--training.seq_len", "32",
        "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", schedule,
        "--parallelism.pipeline_parallel_microbatch_size", "1", "--training.local_batch_size", str(microbatches),
    ]


def assert_same_estimate(fast: memory.MemoryEstimate, full: memory.MemoryEstimate) -> None:
    """Every phase's peak, where it happened, the breakdown at the peak and the training state agree,
    byte for byte (the shortcuts are exact, not merely within 1%)."""
    assert [(p.step, p.phase, p.module, p.peak) for p in fast.phases] == [
        (p.step, p.phase, p.module, p.peak) for p in full.phases
    ]
    assert fast.categories == full.categories
    assert (fast.pipeline_microbatches, fast.parameter_bytes, fast.gradient_bytes, fast.optimizer_state) == (
        full.pipeline_microbatches, full.parameter_bytes, full.gradient_bytes, full.optimizer_state
    )


def shortcut_sizes(schedule: str) -> tuple[int, int, int]:
    """(stages, first, step) of the microbatch plan for ``schedule`` at pp 2."""
    stages = 2 if schedule in SINGLE_STAGE_SCHEDULES else 4
    return (stages, *shortcuts.affine_from(schedule, 2, stages))


FSDP_FULL_AC = ["--parallelism.data_parallel_shard_degree", "2", "--activation_checkpoint.mode", "full"]


def run_pipeline_steps(cfg, world_size: int, derive: bool) -> memory._Run:
    """Rank 0's two steps of ``cfg`` (every block, every microbatch), the second derived or run."""
    import torch

    from titanctl.planning.memory.fake import fake_tensor_mode
    from titanctl.planning.memory.tracker import untracked_sharding_propagation

    plan = memory.plan_estimate(cfg, world_size, all_layers=True, all_microbatches=True)
    with memory.fake_process_group(world_size, 0):
        plan.dims.mesh  # noqa: B018
        with untracked_sharding_propagation():
            return memory._run_steps(
                plan.cfg, plan.dims, plan.args, torch.device("cpu"), accum=plan.accum, steps=2, period=plan.period,
                fake_mode=fake_tensor_mode(allow_non_fake_inputs=True), derive_second_step=derive,
            )


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.slow
def test_pipeline_second_step_derived_equals_running_it(schedule):
    """A pipeline's second step, derived from its first (each schedule action's peak plus what was
    alive when the step's first action began; memory._second_pipeline_step), equals running it: every
    (phase, place, action)'s peak, breakdown and module, byte for byte. Rank 0 of pp 2 under FSDP 2
    with full AC (as the big recipes), one block per stage, the microbatch count the shortcut runs."""
    stages, first, step = shortcut_sizes(schedule)
    cfg = load_config(REPO / "recipes/llama3_debug.toml", [*pipeline_overrides(schedule, stages, first + step), *FSDP_FULL_AC])
    derived, run = run_pipeline_steps(cfg, 4, derive=True), run_pipeline_steps(cfg, 4, derive=False)
    assert derived.second_step_derived and not run.second_step_derived
    assert {key for key in run.peaks if key[0] == 2}, "no second step"
    assert {k: (p.total, p.categories, p.module) for k, p in derived.peaks.items()} == {
        k: (p.total, p.categories, p.module) for k, p in run.peaks.items()
    }


@pytest.mark.slow
def test_pipeline_second_step_runs_under_gradient_accumulation():
    """With two pipeline schedules per step (gradient accumulation), the second frees what the set-up
    left alive in the first: step 2 then differs from step 1 by more than a constant, and is run."""
    cfg = load_config(REPO / "recipes/llama3_debug.toml", [
        *pipeline_overrides("1F1B", 2, 4), "--training.global_batch_size", "8"])
    run = run_pipeline_steps(cfg, 2, derive=True)
    assert not run.second_step_derived and any(key[0] == 2 for key in run.peaks)


def _torch_tracker_dispatch(self, func, types, args=(), kwargs=None):
    """The trackers' per-op accounting as torch does it (what tracker._StepPeaks.__torch_dispatch__ did
    before it took the shorter way)."""
    from titanctl.planning.memory import tracker

    if tracker._propagating or func is tracker._DEVICE_QUERY:
        return func(*args, **(kwargs or {}))
    return super(tracker._StepPeaks, self).__torch_dispatch__(func, types, args, kwargs)


def tracked_runs(plan: memory.Plan) -> dict:
    """What the tracker saw in each run of ``plan`` (shortcuts.runs_to_make), place by place: (step,
    phase, place) -> (peak, breakdown, module), and the state after the first step."""
    import torch

    from titanctl.planning.memory.fake import fake_tensor_mode
    from titanctl.planning.memory.tracker import untracked_sharding_propagation

    out, dims = {}, dataclasses.replace(plan.dims)  # its own mesh, on this fake process group
    with memory.fake_process_group(plan.world_size, plan.rank):
        dims.mesh  # noqa: B018
        with untracked_sharding_propagation():
            for n_layers, count, steps in shortcuts.runs_to_make(plan.depths, plan.microbatches,
                                                                 plan.count_slope_at_one_depth):
                run_cfg = memory._with_pipeline_microbatches(plan.cfg, count) if count else plan.cfg
                run = memory._run_steps(
                    run_cfg, dims, plan.args.replace(n_layers=n_layers), torch.device("cpu"), accum=plan.accum,
                    steps=steps, period=plan.period, fake_mode=fake_tensor_mode(allow_non_fake_inputs=True),
                    derive_second_step=plan.derive_second_step,
                )
                out[n_layers, count] = (
                    {key: (p.total, p.categories, p.module) for key, p in run.peaks.items()},
                    run.start, run.after_backward, run.optimizer_state,
                )
    return out


@pytest.mark.parametrize(
    "recipe, world_size, overrides",
    [
        ("recipes/llama3_debug.toml", 4, ["--parallelism.tensor_parallel_degree", "2",
                                          "--training.mixed_precision_param", "bfloat16"]),
        ("recipes/llama3_debug.toml", 4, [*pipeline_overrides("1F1B", 2, 4), *FSDP_FULL_AC]),
        ("recipes/qwen3_moe_debug.toml", 4, [*TINY, "--parallelism.expert_parallel_degree", "2",
                                             "--parallelism.pipeline_parallel_degree", "2",
                                             "--parallelism.pipeline_parallel_microbatch_size", "1"]),
        ("recipes/llama3_debug.toml", 2, [*TINY, "--parallelism.tensor_parallel_degree", "2",
                                          "--activation_checkpoint.mode", "full"]),
    ],
    ids=["fsdp2-tp2-bf16", "pp2-fsdp2-ac", "moe-ep2-pp2", "tp2-ac"],
)
@pytest.mark.slow
def test_the_fast_ways_estimate_what_torch_own_code_does(monkeypatch, recipe, world_size, overrides):
    """The estimate's three ways to save time change no byte of it: fake-tensor cache keys built
    directly (checked against torch's, key by key), the trackers' shorter per-op accounting, and a
    pipeline's second step derived from its first; against torch's FakeTensorMode and trackers
    running every step: each place's peak and breakdown in every run, and the estimate."""
    from titanctl.planning.memory import fake, tracker

    assert fake.fast_keys_apply(), "torch's fake-tensor cache key changed: the fast keys are off"
    plan = memory.plan_estimate(load_config(REPO / recipe, overrides), world_size)
    fast = tracked_runs(plan), memory.run_estimate(plan).to_json()
    monkeypatch.setattr(fake.FastKeyFakeTensorMode, "CROSSCHECK", True)
    crosschecked = tracked_runs(plan)
    monkeypatch.setattr(fake, "fast_keys_apply", lambda: False)
    monkeypatch.setattr(tracker._StepPeaks, "__torch_dispatch__", _torch_tracker_dispatch)
    plan = dataclasses.replace(plan, derive_second_step=False)
    reference = tracked_runs(plan), memory.run_estimate(plan).to_json()
    for _, estimate_json in (fast, reference):
        estimate_json.pop("seconds")
    assert fast[0] == crosschecked
    assert fast == reference


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.slow
def test_pipeline_microbatch_shortcut_equals_running_every_microbatch(schedule):
    """Two counts past the schedule's warm-up, extrapolated, equal running all the microbatches.

    Rank 0 of pp 2, one block per stage. The counts are those the plan picks for a long schedule
    (the first two past the warm-up, see shortcuts.affine_from); the full run has two steps more.
    """
    stages, first, step = shortcut_sizes(schedule)
    n = first + 2 * step
    cfg = load_config(REPO / "recipes/llama3_debug.toml", pipeline_overrides(schedule, stages, n))
    full = memory.plan_estimate(cfg, 2, all_microbatches=True)
    assert full.microbatches == [n] and full.depths == [stages]
    fast = dataclasses.replace(full, microbatches=[first, first + step],
                               count_slope_at_one_depth=shortcuts.count_slope_at_one_depth(schedule))
    assert_same_estimate(memory.run_estimate(fast), memory.run_estimate(full))


@pytest.mark.parametrize(
    "schedule, world_size, extra, microbatches",
    [
        ("1F1B", 4, ["--parallelism.data_parallel_shard_degree", "2", "--activation_checkpoint.mode", "full"], 0),
        ("GPipe", 2, [], 0),
        ("Interleaved1F1B", 2, [], 2),
        ("ZBVZeroBubble", 2, [], 2),
    ],
    ids=["1F1B-fsdp-ac", "GPipe", "Interleaved1F1B", "ZBVZeroBubble"],
)
@pytest.mark.slow
def test_pipeline_depth_shortcut_equals_running_every_block(schedule, world_size, extra, microbatches):
    """Stages of 3 and 4 blocks, extrapolated, equal stages of 5 blocks (rank 0 of pp 2).

    One schedule per stage placement: one stage per rank (1F1B under FSDP with full AC, as the 405B
    recipe; GPipe), round robin (Interleaved1F1B) and V (the first and the last stage on rank 0).
    The shallow stages are those the plan picks for deep models (this rank's stages keep three
    blocks). 1F1B and GPipe also take the microbatch shortcut, at the counts of the test above: GPipe
    four runs, two depths by two counts (its memory has a term in depth x count, its activations),
    1F1B three (the larger count at the shallower depth only); the others run ``microbatches``.
    """
    stages, first, step = shortcut_sizes(schedule)
    n = microbatches or first + 2 * step
    cfg = load_config(REPO / "recipes/llama3_debug.toml", [*pipeline_overrides(schedule, 5 * stages, n), *extra])
    full = memory.plan_estimate(cfg, world_size, all_layers=True, all_microbatches=True)
    depths = [3 * stages, 4 * stages]
    fast = dataclasses.replace(
        full, depths=depths, microbatches=full.microbatches if microbatches else [first, first + step],
        layer_names=shortcuts.stage_layer_names(depths, 5 * stages, stages),
        count_slope_at_one_depth=not microbatches and shortcuts.count_slope_at_one_depth(schedule),
    )
    assert_same_estimate(memory.run_estimate(fast), memory.run_estimate(full))


@pytest.mark.parametrize("local_batch_size", [32, 64, 256])
def test_405b_pipeline_runs_the_same_whatever_the_microbatch_count(local_batch_size):
    """Past the warm-up of 1F1B over 8 stages, 32 microbatches or 256 run the same three short runs."""
    cfg = load_config(REPO / "recipes/llama3_405b.toml", [
        "--parallelism.pipeline_parallel_degree", "8", "--parallelism.pipeline_parallel_schedule", "1F1B",
        "--training.local_batch_size", str(local_batch_size),
    ])
    plan = memory.plan_estimate(cfg, 512)
    # 126 layers over 8 stages: rank 0's has 16; the shallow models' 3 and 4.
    assert plan.depths == [126 - 13 * 8, 126 - 12 * 8] and plan.microbatches == [10, 11]
    # 1F1B adds per microbatch what no block changes: the larger count runs at the shallower depth only
    assert shortcuts.runs_to_make(plan.depths, plan.microbatches, plan.count_slope_at_one_depth) == [
        (22, 10, 2), (30, 10, 2), (22, 11, 2)]
    assert plan.pipeline_microbatches == local_batch_size
    assert any(f"{local_batch_size} pipeline microbatches extrapolated from runs of 10 and 11" in note
               for note in plan.notes)
    assert any("hold 3 and 4 layers instead of 16" in note for note in plan.notes)
    everything = memory.plan_estimate(cfg, 512, all_layers=True, all_microbatches=True)
    assert everything.depths == [126] and everything.microbatches == [local_batch_size]
    assert not any("extrapolated" in note for note in everything.notes)


def test_short_pipelines_run_every_microbatch():
    """The two shorter counts are run only when they cost less than the schedule's own count."""
    cfg = load_config(REPO / "recipes/llama3_405b.toml", [
        "--parallelism.pipeline_parallel_degree", "8", "--parallelism.pipeline_parallel_schedule", "1F1B",
        "--training.local_batch_size", "8",
    ])
    assert memory.plan_estimate(cfg, 512).microbatches == [8]  # all warm-up: 1F1B over 8 stages
    plan = shortcuts.microbatch_plan
    assert plan("1F1B", 21, 8, 8, all_microbatches=False) == [21]  # 10 + 11 microbatches would cost as much
    assert plan("1F1B", 22, 8, 8, all_microbatches=False) == [10, 11]
    assert plan("1F1B", 22, 8, 8, all_microbatches=True) == [22]
    # Interleaved schedules run microbatches in rounds: of pp each (80 = 10 rounds of 8) the counts
    # keep whole; rounds of another size (27 = 3 rounds of 9) run as they are.
    assert plan("Interleaved1F1B", 80, 8, 16, all_microbatches=False) == [32, 40]
    assert plan("Interleaved1F1B", 27, 8, 16, all_microbatches=False) == [27]
    assert plan("GPipe", 8, 8, 8, all_microbatches=False) == [3, 4]
    # GPipe's memory has a term in depth x count: both counts run at both depths
    assert shortcuts.runs_to_make([22, 30], [3, 4], shortcuts.count_slope_at_one_depth("GPipe")) == [
        (22, 3, 2), (30, 3, 2), (22, 4, 2), (30, 4, 2)]
    assert shortcuts.runs_to_make([4, 5], [], False) == [(4, 0, 1), (5, 0, 1)]  # no pipeline: one step


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world-size", "6", "--parallelism.tensor_parallel_degree", "4"],
         "world size 6 is not divisible by pp 1 x dp_replicate 1 x cp 1 x tp 4 = 4"),
        (["--world-size", "8", "--parallelism.data_parallel_shard_degree", "2"], "= 2, but the world size is 8"),
        (["--world-size", "2", "--validate"], "2 but 1 process(es) were started"),
        (["--world-size", "2", "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "63"],
         "not divisible by tensor_parallel_degree = 2"),
        (["--world-size", "2", "--device", "gpu"], "--device 'gpu' is not one of auto, cuda, cpu"),
    ],
)
def test_bad_requests_fail_in_one_line_with_exit_code_2(args, message):
    proc = titanctl_run(["estimate-memory", "--config", "recipes/llama3_debug.toml", *args], cwd=REPO, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr


def test_validation_counts_blocks_freed_where_no_profiler_saw_it_once():
    """--validate's count from the profiler's allocation events (time, +size/-size, address, thread).
    Thread 1 trains; thread 2 is a gloo worker. A free on an unprofiled thread leaves no event: the
    address handed out again ends the block that held it (the allocator's own total would keep both)."""
    MiB = 2**20
    events = [
        (10, 4 * MiB, 0xA, 1),  # the training thread's tensor
        (20, 1 * MiB, 0xB, 2),  # gloo scratch: every thread's count only
        (30, -1 * MiB, 0xB, 2),
        (40, 2 * MiB, 0xC, 1),  # freed below on the gloo thread, which records it
        (50, -2 * MiB, 0xC, 2),
        (60, 4 * MiB, 0xA, 1),  # 0xA again: its first block was freed unseen
        (70, 3 * MiB, 0xD, 1),
    ]
    thread, process = memory.peaks_per_step(events, {1: (0, 55), 2: (55, 80)}, training_thread=1)
    assert thread == {1: 6 * MiB, 2: 7 * MiB}
    assert process == {1: 6 * MiB, 2: 7 * MiB}
    thread, process = memory.peaks_per_step(events[:3], {1: (0, 35)}, training_thread=1)
    assert thread == {1: 4 * MiB} and process == {1: 5 * MiB}
    # the gloo thread reusing a training-thread address: that block was freed unseen too
    thread, _ = memory.peaks_per_step([(10, 4 * MiB, 0xA, 1), (20, 1 * MiB, 0xA, 2), (30, 2 * MiB, 0xE, 1)],
                                      {1: (25, 40)}, training_thread=1)
    assert thread == {1: 2 * MiB}


def test_validation_on_cuda_takes_each_steps_allocator_peak():
    """On CUDA --validate reads the caching allocator's peak per step: reset as the step starts (so the
    bytes alive then count), read once the step's kernels have run. A stand-in for torch.cuda records
    the calls; the real one runs on a GPU (scripts/gpu_check.py's memory step)."""

    class Allocator:
        def __init__(self):
            self.calls, self.allocated, self.peak = [], 0, 0

        def synchronize(self, device):
            self.calls.append("sync")

        def reset_peak_memory_stats(self, device):
            self.calls.append("reset")
            self.peak = self.allocated

        def max_memory_allocated(self, device):
            return self.peak

        def use(self, delta):
            self.allocated += delta
            self.peak = max(self.peak, self.allocated)

    cuda, peaks = Allocator(), {}
    marker = memory.cuda_step_peaks("cuda:0", peaks, cuda)
    cuda.use(100)  # weights, before step 1
    with marker(1):
        cuda.use(50)
        cuda.use(-50)
    cuda.use(30)  # Adam's state stays
    with marker(2):
        cuda.use(10)
    assert peaks == {1: 150, 2: 140}
    assert cuda.calls == ["sync", "reset", "sync"] * 2


MUON = ["--optimizer.name", "Muon"]


@pytest.mark.slow
def test_muon_deep_models_extrapolate_exactly():
    """Under Muon, ten blocks from runs of four and five equal running all ten (FSDP 4), byte for byte: the
    optimizer step's peak holds the state (affine in depth) plus one matrix's gathered update and
    Newton-Schulz temporaries, the largest of which rank 0 always holds (each shape dealt on its own)."""
    args = ["--model.n_layers", "10", "--training.seq_len", "64", *MUON]
    fast = estimate("recipes/llama3_debug.toml", 4, args)
    full = estimate("recipes/llama3_debug.toml", 4, args, all_layers=True)
    assert fast.layers_run == [4, 5] and full.layers_run == [10]
    assert_same_estimate(fast, full)


@pytest.mark.slow
def test_muon_holds_one_buffer_per_hidden_matrix_and_its_step_is_measured():
    """Muon's estimate is AdamW's less one fp32 state per hidden matrix, and its peak (here the optimizer
    step: short sequences) agrees with the real step's, measured (--validate's measurement, one process)."""
    import torch

    from titanctl.models.registry import build_model

    common = ["--model.n_layers", "2", "--training.seq_len", "16", "--training.local_batch_size", "1",
              "--training.mixed_precision_param", "float32"]
    plan = memory.plan_estimate(load_config(REPO / "recipes/llama3_debug.toml", [*common, *MUON]), 1)
    muon = memory.run_estimate(plan)
    adamw = estimate("recipes/llama3_debug.toml", 1, common)
    with torch.device("meta"):
        model = build_model(plan.args)
    hidden = 4 * sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2)
    assert muon.optimizer_state["momentum_buffer"] == hidden
    def moments(e):  # the step counters (4 bytes per AdamW parameter) left out
        return sum(v for k, v in e.optimizer_state.items() if k != "step")

    assert moments(adamw) - moments(muon) == hidden
    backward = {p.step: p.peak for p in adamw.phases if p.phase == "backward"}
    steps = adamw.optimizer_state["step"] - muon.optimizer_state["step"]
    assert {p.step: backward[p.step] - p.peak for p in muon.phases if p.phase == "backward"} == {1: 0, 2: hidden + steps}
    assert (muon.peak_step, muon.peak_phase) == (1, "optimizer step")
    measured = memory.validate(plan, muon)
    ratios = {step: measured.estimated[step] / measured.allocated[step] for step in (1, 2)}
    print(f"\nMUON estimate {muon.peak / 2**20:.2f} MiB (AdamW {adamw.peak / 2**20:.2f} MiB), measured "
          f"{ {s: round(measured.allocated[s] / 2**20, 2) for s in (1, 2)} } MiB: ratios {ratios}")
    assert all(abs(r - 1) <= 0.15 for r in ratios.values()), ratios


def test_the_report_names_the_recipes_family(capsys):
    """The header says the recipe's model.name and flavor (it said "Llama 3.1" for every family)."""
    from titanctl.cli.estimate_memory import print_report

    e = estimate("recipes/qwen3_debug.toml", 1, TINY)
    assert e.model == "qwen3"
    print_report(e, None, 0)
    header = capsys.readouterr().out.splitlines()[0]
    assert ": qwen3 debugmodel (" in header and "Llama" not in header


def test_ulysses_is_estimated_by_running_its_all_to_alls():
    """The estimate runs the method's own step: at CP 4 over Llama's 2 KV heads, Ulysses repeats each KV head
    to 4 (one per rank) before its all-to-all, and attention keeps those copies, which the ring never makes."""
    args = ["--model.n_layers", "2", "--training.seq_len", "1024", "--training.local_batch_size", "1",
            "--parallelism.context_parallel_degree", "4", "--activation_checkpoint.mode", "none"]
    ring, ulysses = (estimate("recipes/llama3_debug.toml", 4, [*args, "--parallelism.context_parallel_method", m],
                              device="cpu") for m in ("ring", "ulysses"))
    # per layer, k and v as 1 head x 1024 positions x 32 channels (fp32) where the ring keeps 2 heads x 256
    repeated = 2 * 2 * (1024 - 2 * 256) * 32 * 4
    assert ulysses.categories["activations"] - ring.categories["activations"] == pytest.approx(repeated, rel=0.2)


def test_each_context_parallel_method_holds_its_own_masks():
    """A document mask (block_causal) on CPU is kept as the documents' starts (O(S)) by every route: the masked
    ring (ring CP 4) makes its (S / cp)^2 blocks one at a time; one process and Ulysses (whose kernels see every
    query) attend by spans, one chunk's block of the mask (SPAN_CHUNK_ROWS x S, fp32) at a time. Nothing S x S
    (the dense route held 1 + 4 x layers bytes a pair). The plan's fast path charges each what this measures (the
    chunk's block an upper bound: under Ulysses it is freed before the peak)."""
    from titanctl.models.common.span_attention import SPAN_CHUNK_ROWS
    from titanctl.planning.plan.candidates import Candidate
    from titanctl.planning.plan.memory_model import Masks

    seq, cp = 2048, 4
    held = {}
    for method, degree in (("ring", cp), ("ulysses", cp), ("one process", 1)):
        args = ["--model.n_layers", "1", "--training.seq_len", str(seq), "--training.local_batch_size", "1",
                "--parallelism.context_parallel_degree", str(degree), "--activation_checkpoint.mode", "none"]
        if degree > 1:
            args += ["--parallelism.context_parallel_method", method]
        runs = [estimate("recipes/llama3_debug.toml", degree, [*args, "--model.attn_mask_type", mask], device="cpu")
                for mask in ("causal", "block_causal")]
        held[method] = runs[1].categories["activations"] - runs[0].categories["activations"]
    # the ring's about nothing (the (S / cp) x S mask it once held would be 1.0 of this): the masked ring keeps a
    # little less K/V than torch's causal ring, and its one block of the mask at a time is freed before the peak
    assert abs(held["ring"]) <= 0.05 * seq * seq / cp
    chunk_block = SPAN_CHUNK_ROWS * seq * 4
    assert held["one process"] == pytest.approx(chunk_block + 8 * seq, rel=0.01)
    assert 0 <= held["ulysses"] <= 0.01 * seq * seq
    fast = Masks(with_cp=True, without_cp=True)
    assert fast.bytes(Candidate(1, 1, 1, 1, cp, 1, 1, 1, cp_method="ring"), seq, act=4) == 0
    charged = fast.bytes(Candidate(1, 1, 1, 1, cp, 1, 1, 1, cp_method="ulysses"), seq, act=4)
    assert held["ulysses"] <= charged == chunk_block + 8 * seq
    alone = fast.bytes(Candidate(1, 1, 1, 1, 1, 1, 1, 1), seq, act=4)
    assert alone == pytest.approx(held["one process"], rel=0.01)

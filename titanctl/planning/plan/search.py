"""`titanctl plan`: every layout of a recipe on N devices, the ones that fit, ranked by step time.

1. The recipe's model, sequence length and global batch (``training.global_batch_size``, or with -1
   the recipe's own local batch x the data-parallel degree its layout gets on N devices). N above
   MAX_DEVICES, or a batch above MAX_TOKENS_PER_STEP, is beyond any real job and refused at once.
2. ``candidates.enumerate_splits``: the degrees and batch splits the trainer accepts (the rest counted by reason).
3. ``memory_model.estimate`` (fast) drops the ones that do not fit; ``cost_model`` times the others,
   keeping only the fastest that can be shown (memory stays bounded over millions of layouts).
4. The fastest go to ``estimate-memory``'s engine (exact, rank 0) in order, within a count and a
   time budget; a finalist that does not fit after all is dropped (and counted), the next moves up.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from titanctl.config.job_config import JobConfig
from titanctl.errors import ParallelError, TitanError
from titanctl.planning.plan import memory_model
from titanctl.planning.plan.candidates import (
    AC_MODES,
    Candidate,
    check_candidate,
    enumerate_splits,
    job_config,
    variants,
)
from titanctl.planning.plan.cost_model import CostModel, Setting, StepTime
from titanctl.planning.plan.devices import Device
from titanctl.planning.plan.memory_model import GIB
from titanctl.planning.plan.workload import model_shape

# Schedules that run each backward as two passes (input gradients, then weight gradients).
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# Bounds beyond any real job, so that a mistyped number is refused at once instead of enumerated for hours:
# the largest clusters hold a few hundred thousand GPUs, and the largest published batches are tens of
# millions of tokens per step (Llama 3 405B: 16M; DeepSeek-V3: 15,360 x 4,096 = 63M).
MAX_DEVICES = 2**20
MAX_TOKENS_PER_STEP = 2**30
# Above this many layouts to time (half a minute or more), the plan says so before it starts.
MANY_LAYOUTS = 500_000
# Layouts timed beyond twice the ones that can be shown before the list is cut back to those.
CUT_AFTER = 10_000


@dataclass
class Layout:
    candidate: Candidate
    fast_memory: float  # bytes, the fast path's peak (busiest pipeline rank), without the reserve
    time: StepTime
    tokens_per_second_per_device: float
    mfu: float
    exact_memory: float | None = None  # bytes, estimate-memory's peak of rank 0 (finalists)
    exact_seconds: float = 0.0
    # bytes, the fast path's peak of the pipeline ranks after rank 0, which the exact estimate does not run
    # (the last stage holds the logits); 0 without a pipeline
    later_ranks_memory: float = 0.0

    @property
    def memory(self) -> float:
        if self.exact_memory is None:
            return self.fast_memory
        return max(self.exact_memory, self.later_ranks_memory)

    @property
    def memory_is_exact(self) -> bool:
        return self.exact_memory is not None and self.exact_memory >= self.later_ranks_memory


@dataclass
class Plan:
    recipe: str
    model: str
    world_size: int
    device: Device
    global_batch: int
    seq_len: int
    layouts: list[Layout]  # the best, fastest first
    considered: int  # layouts the trainer accepts
    rejected: Counter  # reason -> count (trainer's refusals, memory)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def commands(self, layout: Layout) -> dict[str, str]:
        """Ready-to-run lines: torchrun on each node, and the Slurm script."""
        per_node = min(self.device.gpus_per_node, self.world_size)
        nodes = -(-self.world_size // per_node)
        args = " ".join(layout.candidate.overrides(self.global_batch))
        launch = f"torchrun --nproc_per_node {per_node}"
        if nodes > 1:
            launch = (f"torchrun --nnodes {nodes} --nproc_per_node {per_node} --rdzv_backend c10d "
                      "--rdzv_endpoint HEAD_NODE:29500")
        return {
            "overrides": args,
            "torchrun": f"{launch} -m titanctl train --config {self.recipe} {args}",
            "slurm": f"sbatch --nodes={nodes} --gpus-per-node={per_node} slurm/multinode_trainer.slurm "
                     f"{self.recipe} {args}",
            "nodes": nodes,
            "processes_per_node": per_node,
        }

    def to_json(self) -> list[dict]:
        out = []
        for rank, layout in enumerate(self.layouts, 1):
            t = layout.time
            cmd = self.commands(layout)
            out.append({
                "rank": rank,
                **layout.candidate.to_json(),
                "memory_gib": round(layout.memory / GIB, 3),
                "memory_exact": layout.memory_is_exact,
                "memory_fast_gib": round(layout.fast_memory / GIB, 3),
                "memory_capacity_gib": round(self.device.memory_gib - self.device.memory_reserve_gib, 3),
                "step_s": t.step,
                "tokens_per_second_per_device": layout.tokens_per_second_per_device,
                "mfu": layout.mfu,
                "dominant": t.dominant,
                "compute_s": t.compute,
                "exposed_comm_s": t.exposed_comm,
                "bubble_s": t.bubble,
                "comm_total_s": t.comm_total,
                "terms_s": t.terms,
                "overrides": cmd["overrides"],
                "torchrun": cmd["torchrun"],
                "slurm": cmd["slurm"],
                "nodes": cmd["nodes"],
                "processes_per_node": cmd["processes_per_node"],
            })
        return out


def default_global_batch(cfg: JobConfig, world_size: int) -> tuple[int, str]:
    """The recipe's global batch on ``world_size`` devices, and how it was found."""
    from titanctl.parallel.layouts.dims import ParallelDims

    t = cfg.training
    if t.global_batch_size != -1:
        return t.global_batch_size, "training.global_batch_size"
    try:
        dp = ParallelDims.from_config(cfg.parallelism, world_size).dp
        how = f"the recipe's local_batch_size {t.local_batch_size} x its data-parallel degree {dp} on {world_size}"
    except ParallelError:
        dp = world_size
        how = f"the recipe's local_batch_size {t.local_batch_size} x {world_size} (its degrees do not fit)"
    return t.local_batch_size * dp, how


class Planner:
    """One recipe on one device kind: enumerates, filters and times layouts."""

    def __init__(self, recipe_path: str, cfg: JobConfig, device: Device):
        from titanctl.models.registry import model_args_from_config, spec_of
        from titanctl.planning.memory.estimate import resolve_vocab_size

        self.recipe_path = recipe_path
        self.cfg = cfg
        self.device = device
        vocab, note = resolve_vocab_size(cfg)
        self.notes = [note] if note else []
        self.args = model_args_from_config(cfg.model, vocab, cfg.training.seq_len)
        self.shape = model_shape(self.args)
        seq = cfg.training.seq_len
        self.flops_per_token = spec_of(self.args).flops_per_token(self.args, seq)
        self.dtype = cfg.training.mixed_precision_param
        self.cost = CostModel(self.shape, Setting.of_model(device, self.dtype, self.args, seq,
                                                           cfg.model.attn_mask_type))
        self.ranks = memory_model.Ranks(self.shape)
        self.adapters = memory_model.adapters_of(self.args, cfg.lora) if cfg.lora.enable else None
        self.masks = memory_model.masks_of(self.args, cfg.model.attn_mask_type, device.target)

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def capacity(self) -> float:
        return (self.device.memory_gib - self.device.memory_reserve_gib) * GIB

    def fast_memory(self, c: Candidate, after_rank0: bool = False) -> float:
        """The fast path's peak (bytes, without the device's reserve; ``after_rank0``: of the pipeline ranks
        after rank 0, 0 without a pipeline); compile, Float8 and async TP are not modelled in memory (as
        estimate-memory, which runs them as bf16 eager)."""
        t, p = self.cfg.training, self.cfg.parallelism
        peak = memory_model.estimate(
            self.shape, self.ranks, c, seq_len=t.seq_len, param_dtype=t.mixed_precision_param,
            reduce_dtype=t.mixed_precision_reduce, reshard_after_forward=p.fsdp_reshard_after_forward, reserve_gib=0.0,
            loss_parallel=not p.disable_loss_parallel, after_rank0=after_rank0, adapters=self.adapters,
            optimizer=self.cfg.optimizer.name, muon_experts=self.cfg.optimizer.muon_experts, masks=self.masks,
        )
        return 0.0 if peak is None else peak.total

    def evaluate(self, c: Candidate, global_batch: int, fast_memory: float | None = None) -> Layout:
        t = self.cfg.training
        reduce_bytes = 4 if t.mixed_precision_reduce == "float32" else 2
        step = self.cost.step_time(c, self.ranks, self.dtype_bytes, reduce_bytes,
                                   self.cfg.parallelism.fsdp_reshard_after_forward)
        tps = global_batch * t.seq_len / step.step / c.world_size
        peak = self.device.peak_tflops(self.dtype)
        memory = self.fast_memory(c) if fast_memory is None else fast_memory
        return Layout(c, memory, step, tps, tps * self.flops_per_token / (peak * 1e12))

    def exact_memory(self, c: Candidate, global_batch: int, timeout: float | None = None) -> tuple[float | None, float]:
        """estimate-memory's peak for rank 0 (bytes; None if it did not finish within ``timeout`` seconds)
        and the seconds it took.

        Each estimate runs in a forked child: two estimates of different layouts in one process
        failed here (torch 2.13: the second could not resolve a process group of the first's fake
        world by name); the child also gives its memory back, and can be stopped at the time budget.
        """
        import multiprocessing

        cfg = job_config(self.cfg, c, global_batch)
        started = time.perf_counter()
        context = multiprocessing.get_context("fork")
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_exact_child,
                                args=(send, cfg, c.world_size, self.device.target, self.recipe_path))
        child.start()
        send.close()
        if not receive.poll(timeout):
            child.kill()
            child.join()
            return None, time.perf_counter() - started
        try:
            kind, value = receive.recv()
        except EOFError:
            kind, value = "crash", "the estimate's process ended without an answer"
        child.join()
        if kind != "ok":
            raise ParallelError(f"estimate-memory failed for {c.describe()}: {value}")
        return value, time.perf_counter() - started


def _exact_child(send, cfg: JobConfig, world_size: int, target: str, recipe: str) -> None:
    import os

    from titanctl.planning.memory import plan_estimate, run_estimate

    # torch's warnings about the layouts it builds are the estimate's business, not the plan's output.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        estimate = run_estimate(plan_estimate(cfg, world_size, device=target, recipe=recipe))
        send.send(("ok", float(estimate.peak)))
    except TitanError as e:
        send.send(("error", str(e)))
    except Exception as e:
        send.send(("error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    send.close()
    os._exit(0)  # no atexit handlers of the parent's copy (and no gloo/abort at exit)


def plan(
    recipe_path: str, cfg: JobConfig, world_size: int, device: Device, *, global_batch: int | None = None,
    top: int = 5, exact: int = 3, budget_seconds: float = 45.0, schedules: tuple[str, ...] | None = None,
    ac_modes: tuple[str, ...] = AC_MODES, compile_options: tuple[bool, ...] = (False, True),
    float8: bool = True, log: Callable[[str], None] | None = None,
) -> Plan:
    """The ``top`` fastest layouts of the recipe on ``world_size`` devices that fit. ``log`` hears
    that the plan will take minutes, before it does."""
    from titanctl.parallel.layouts.pipeline_stages import SCHEDULES

    started = time.perf_counter()
    check_world_size(world_size)
    if cfg.parallelism.pipeline_parallel_schedule_csv:
        # A CSV fixes one schedule; the plan compares the named ones.
        parallelism = dataclasses.replace(cfg.parallelism, pipeline_parallel_schedule_csv="")
        cfg = dataclasses.replace(cfg, parallelism=parallelism)
    planner = Planner(recipe_path, cfg, device)
    notes = list(planner.notes)
    if global_batch is None:
        global_batch, how = default_global_batch(cfg, world_size)
        notes.append(f"global batch {global_batch} sequences: {how} (--global-batch sets it)")
    elif global_batch < 1:
        raise ParallelError(f"--global-batch must be at least 1, got {global_batch}")
    else:
        how = "--global-batch"
    check_tokens_per_step(global_batch, cfg.training.seq_len, how)
    enum = enumerate_splits(cfg, planner.args, world_size, global_batch, gpus_per_node=device.gpus_per_node,
                            schedules=schedules or SCHEDULES)
    rejected = Counter(enum.rejected)
    model = f"{cfg.model.name} {cfg.model.flavor}"
    if not enum.splits:
        reasons = "; ".join(f"{r} ({n})" for r, n in rejected.most_common(3))
        raise ParallelError(f"no layout of {model} uses {world_size} devices with a global batch of "
                            f"{global_batch}: {reasons}")
    # float8 linears do not carry LoRA adapters (lora.check_lora refuses the pair).
    use_float8 = float8 and device.peak_fp8_tflops > 0 and device.target == "cuda" and not cfg.lora.enable
    to_time = len(enum.splits) * len(ac_modes) * len(compile_options) * (2 if use_float8 else 1)  # at most
    if log is not None and to_time > MANY_LAYOUTS:
        log(f"timing about {to_time:,} layouts ({len(enum.splits):,} sets of degrees and batch splits): this takes "
            "minutes (--ac, --no-float8 or a global batch with fewer divisors make fewer)")
    fitting: list[Layout] = []
    # Only the fastest ``top + exact`` can be shown (each exact estimate drops at most one), so the list is
    # cut to them now and then: millions of layouts are timed in bounded memory. The sort is stable, so
    # this keeps exactly what sorting them all would.
    keep = top + exact
    smallest = None
    considered = 0
    for split in enum.splits:
        for ac in ac_modes:
            base = dataclasses.replace(split, ac=ac)
            if ac == "selective_op" and split.pp_schedule in SPLIT_BACKWARD:
                # Found by estimate-memory's engine (torch 2.13): "You are only allowed to backward once
                # on any region computed under selective activation checkpoint", which these schedules'
                # separate input- and weight-gradient passes do.
                rejected["zero-bubble schedules split backward in two: op-level selective AC allows one"] += 1
                continue
            options = list(variants(base, compile_options=compile_options, float8=use_float8,
                                    async_tp=device.async_tp))
            considered += len(options)
            mem = planner.fast_memory(base)
            if mem > planner.capacity:
                rejected["does not fit in memory (fast estimate)"] += len(options)
                if smallest is None or mem < smallest[0]:
                    smallest = (mem, base)
                continue
            fitting.extend(planner.evaluate(c, global_batch, mem) for c in options)
            if len(fitting) > 2 * keep + CUT_AFTER:
                fitting = heapq.nsmallest(keep, fitting, key=_step_seconds)
    if not fitting:
        mem, c = smallest
        raise ParallelError(
            f"no layout of {model} on {world_size} x {device.name} fits in {planner.capacity / GIB:.1f} GiB "
            f"(memory less the {device.memory_reserve_gib:g} GiB reserve): the smallest, {c.describe()} with "
            f"{c.features()}, needs {mem / GIB:.1f} GiB; use more devices or a smaller global batch"
        )
    fitting.sort(key=_step_seconds)
    chosen: list[Layout] = []
    exact_done = 0
    out_of_time = False
    for layout in fitting:
        if len(chosen) >= top:
            break
        left = budget_seconds - (time.perf_counter() - started)
        if exact_done < exact and not out_of_time and left > 0:
            try:
                peak, seconds = planner.exact_memory(layout.candidate, global_batch, timeout=left)
            except ParallelError as e:  # the step itself fails for this layout: it cannot be printed
                rejected[f"estimate-memory's step failed: {str(e).split(': ', 1)[-1][:80]}"] += 1
                exact_done += 1
                continue
            exact_done += 1
            if peak is None:
                out_of_time = True
                notes.append(f"the exact estimate of {layout.candidate.describe()} did not finish within the time "
                             f"budget ({budget_seconds:g} s, --budget-seconds): it and the layouts after it show "
                             "the fast estimate")
            else:
                layout.exact_memory, layout.exact_seconds = peak, seconds
                layout.later_ranks_memory = planner.fast_memory(layout.candidate, after_rank0=True)
                if layout.memory > planner.capacity:
                    rejected["does not fit in memory (exact estimate)"] += 1
                    continue
        elif exact_done < exact and not out_of_time:
            out_of_time = True
            notes.append(f"exact memory estimates for the first {exact_done} layout(s) only: the time budget of "
                         f"{budget_seconds:g} s was reached (the others show the fast estimate)")
        check_candidate(cfg, layout.candidate, global_batch, planner.args)  # what is printed, the trainer accepts
        chosen.append(layout)
    result = Plan(recipe_path, model, world_size, device, global_batch, cfg.training.seq_len, chosen,
                  considered, rejected, notes=notes)
    result.seconds = time.perf_counter() - started
    return result


def _step_seconds(layout: Layout) -> float:
    return layout.time.step


def check_world_size(world_size: int) -> None:
    """One line for a device count no plan can be for (before anything is enumerated)."""
    if world_size < 1:
        raise ParallelError(f"--gpus must be at least 1, got {world_size}")
    if world_size > MAX_DEVICES:
        raise ParallelError(f"--gpus {world_size:,} is more devices than any cluster holds: the plan takes at most "
                            f"{MAX_DEVICES:,} (2^20)")


def check_tokens_per_step(global_batch: int, seq_len: int, how: str) -> None:
    """One line for a global batch beyond any real run's (before its divisors are enumerated)."""
    tokens = global_batch * seq_len
    if tokens > MAX_TOKENS_PER_STEP:
        raise ParallelError(
            f"a global batch of {global_batch:,} sequences of {seq_len:,} tokens ({how}) is {tokens:,} tokens per "
            f"step, beyond any real run's (the largest published: tens of millions): the plan takes at most "
            f"{MAX_TOKENS_PER_STEP:,} (2^30){'' if how == '--global-batch' else '; --global-batch sets a smaller one'}"
        )


def evaluate_layouts(recipe_path: str, cfg: JobConfig, device: Device, candidates: list[Candidate],
                     global_batch: int) -> list[Layout]:
    """The cost model's prediction for given layouts (each checked by the trainer's rules first)."""
    planner = Planner(recipe_path, cfg, device)
    out = []
    for c in candidates:
        try:
            check_candidate(cfg, c, global_batch, planner.args)
        except TitanError as e:
            raise ParallelError(f"layout {c.describe()}: {e}") from None
        out.append(planner.evaluate(c, global_batch))
    return out


def ac_modes_from(text: str, cfg: JobConfig) -> tuple[str, ...]:
    """--ac: all, recipe, or a comma list of the plan's names for activation checkpointing."""
    from titanctl.errors import ConfigError

    if text == "all":
        return AC_MODES
    if text == "recipe":
        ac = cfg.activation_checkpoint
        if ac.mode != "selective":
            return (ac.mode,)
        if ac.selective_ac_option not in ("op", "2"):
            raise ConfigError(f"--ac recipe: the plan models selective_ac_option op or 2, not "
                              f"{ac.selective_ac_option!r}; give --ac with the modes to consider")
        return (f"selective_{ac.selective_ac_option}",)
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in AC_MODES]
    if bad or not modes:
        raise ConfigError(f"--ac {text!r}: give all, recipe, or a comma list of {', '.join(AC_MODES)}")
    return modes


def recipe_config(path: Path) -> JobConfig:
    from titanctl.config.recipe import load_config

    return load_config(path, [])

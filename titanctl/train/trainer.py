"""The training loop: forward, loss, backward, clip, step, metrics."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from titanctl.checkpoint.run.manager import CheckpointManager, LoadPlan, complete_checkpoints, plan_load
from titanctl.config.job_config import JobConfig
from titanctl.data.dataloader import TokenWindowLoader
from titanctl.data.mixture import sources_from_config
from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from titanctl.errors import ConfigError, TitanError, TrainingDiverged
from titanctl.gc_pauses import automatic_gc_paused
from titanctl.models.registry import model_args_from_config, with_training_keys
from titanctl.models.shapes import num_params
from titanctl.parallel.converters.float8 import emulation_note, precompute_float8_scales
from titanctl.parallel.layouts.build import build_model_parts, check_layout
from titanctl.parallel.layouts.cp_balance import imbalance
from titanctl.parallel.layouts.dims import ParallelDims
from titanctl.parallel.layouts.reductions import StepLosses, clip_grad_norm, global_mean_loss
from titanctl.parallel.layouts.tensor_parallel import check_async_tp
from titanctl.parallel.runtime import elastic, hang_watchdog
from titanctl.parallel.runtime.env import device_type, init_process, read_layout, use_deterministic_algorithms
from titanctl.parallel.runtime.fault_tolerance import ReplicaGroup, Trainable
from titanctl.parallel.runtime.peers import peer_failures_named
from titanctl.safe_io import shown, visible
from titanctl.train import run_folder
from titanctl.train.flops import flops_per_token, throughput
from titanctl.train.loss import build_loss_fn
from titanctl.train.lr_schedule import build_lr_scheduler
from titanctl.train.metrics import MemoryMonitor, MetricSinks
from titanctl.train.moe_balance import MoEBalance, check_moe_keys, gather_over_pipeline, load_metrics
from titanctl.train.optim import build_optimizer
from titanctl.train.peak import device_peak_tflops, slow_compute_note
from titanctl.train.step import ForwardBackward
from titanctl.train.step_profiler import check_profiling, maybe_profile
from titanctl.train.validate import ValidationSet, Validator


class Trainer:
    """One run: built by ``__init__`` (which owns the dump folder from then on), run once by ``train``."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.dump_folder = Path(cfg.job.dump_folder)
        self.flight_recorder_folder = self.dump_folder / run_folder.FLIGHT_RECORDER_FOLDER
        self._preflight()
        with peer_failures_named(self.rank, self.dims.world_size, "while the job was setting up"):
            self._set_up()

    def _preflight(self) -> None:
        """What the config alone decides, checked by every rank before it joins the process group (and
        before anything is written): a refused layout or model never leaves a rank connected to peers that
        already left, whose broken sockets would end it in a traceback instead of the refusal."""
        cfg = self.cfg
        self.rank, _, world_size, _ = read_layout()
        self.dims = ParallelDims.from_config(cfg.parallelism, world_size)
        self.tokenizer = Tokenizer(cfg.model.tokenizer_path or DEFAULT_TOKENIZER_PATH)
        self.model_args = with_training_keys(
            model_args_from_config(cfg.model, self.tokenizer.vocab_size, cfg.training.seq_len), cfg.model)
        self._check_config()

    def _check_config(self) -> None:
        """The relations between keys, the layout and the model that training needs (``_preflight``)."""
        cfg = self.cfg
        check_moe_keys(cfg.moe, self.model_args, cfg.model.name)
        check_layout(cfg, self.dims, self.model_args)
        if self.dims.tp > 1 and cfg.parallelism.enable_async_tensor_parallel:
            check_async_tp(device_type(), cfg.compile.enable)
        check_profiling(cfg.profiling, device_type())

    def _set_up(self) -> None:
        cfg = self.cfg
        self.env = init_process(
            cfg.comm.init_timeout_seconds, cfg.comm.trace_buf_size, self.flight_recorder_folder
        )
        self.attempt = elastic.Attempt.from_env()
        self.is_logging_rank = self.env.rank in cfg.job.log_ranks
        self.console = Console(quiet=not self.is_logging_rank, no_color=cfg.metrics.disable_color_printing, emoji=False)
        self.sinks = None
        self.ft: ReplicaGroup | None = None
        # torchft: this process is rank r of one replica group; the data is split over all groups.
        ft = cfg.fault_tolerance
        self.groups, self.group_index = (ft.group_size, ft.replica_id) if ft.enable else (1, 0)
        self._lock = self._own_dump_folder()
        if self._lock is not None:  # also when a Trainer is dropped without training
            weakref.finalize(self, self._lock.release)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _own_dump_folder(self) -> run_folder.RunLock | None:
        """Rank 0 makes the dump folder and locks it for the whole job; every rank learns the outcome."""
        lock, outcome = None, ("ok", None)
        if self.env.rank == 0:
            try:
                c = self.cfg
                run_folder.prepare(self.dump_folder, [
                    c.checkpoint.folder, c.metrics.save_tb_folder, c.profiling.save_traces_folder,
                    c.profiling.save_memory_snapshot_folder, self.flight_recorder_folder.name,
                ], written=run_folder.folders_written(c, self.env.distributed))
                lock = run_folder.RunLock(self.dump_folder)
                outcome = ("ok", lock.acquire())
            except TitanError as e:
                outcome = ("refused", str(e))
        if self.env.distributed:
            box = [outcome]
            dist.broadcast_object_list(box, src=0)
            outcome = box[0]
        if outcome[0] == "refused":
            raise ConfigError(outcome[1])
        if outcome[1]:
            self.console.print(f"[yellow]{shown(outcome[1])}[/yellow]", soft_wrap=True)
        if self.env.device.type == "cuda" and self.env.distributed and self.cfg.comm.trace_buf_size:
            hang_watchdog.create_nccl_dump_folder(self.flight_recorder_folder)
        return lock

    def close(self) -> None:
        """Release the dump folder (the end of ``train``, or a failed ``__init__``)."""
        if self.ft is not None:
            self.ft.close()
            self.ft = None
        if self.sinks is not None:
            self.sinks.close()
            self.sinks = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _build(self) -> None:
        cfg = self.cfg
        if cfg.fault_tolerance.enable:
            self.ft = ReplicaGroup(cfg, self.env.rank, self.env.world_size, self.dump_folder, self.env.device)
            self.say(f"{self.ft.describe()}: rank {self.env.rank} of {self.env.world_size}")
        torch.manual_seed(cfg.training.seed)
        if cfg.training.deterministic:
            use_deterministic_algorithms(self.env.device)

        # A checkpoint to resume is chosen and checked before the model exists: a bad one fails fast,
        # and weights that the checkpoint restores need no initialization (costly for big models).
        load_plan = None if cfg.checkpoint.create_seed_checkpoint else plan_load(cfg, self.model_args)
        dp_mesh = self.dims.mesh_for("dp_replicate", "dp_shard") if self.dims.world_size > 1 else None
        dp_degree, dp_rank = self.dims.dp, (dp_mesh.get_local_rank() if dp_mesh is not None else 0)
        global_batch = self._global_batch(load_plan)
        self.loader = TokenWindowLoader(
            sources_from_config(cfg.training, cfg.sft),
            self.tokenizer,
            seq_len=cfg.training.seq_len,
            global_batch_size=global_batch,
            local_batch_size=cfg.training.local_batch_size,
            dp_rank=self.group_index * dp_degree + dp_rank,
            dp_degree=self.groups * dp_degree,
            seed=cfg.training.seed,
            stream_shards=cfg.training.stream_shards,
        )
        self.global_batch = global_batch
        for note in self.loader.notes:  # what became of chat rows
            self.say(note)
        validation_set = None  # built before the model: a validation set too small fails fast
        if cfg.validation.enabled:
            validation_set = ValidationSet.from_config(
                cfg, self.tokenizer, global_batch_size=global_batch, dp_rank=dp_rank, dp_degree=dp_degree,
                chat=self.loader.chat,
            )
            if validation_set.note:
                self.say(validation_set.note)
        # Chat microbatches (training or validation) carry positions, and their counted tokens vary.
        chat = self.loader.chat or (validation_set is not None and validation_set.windows.ndim == 3)

        restores_weights = load_plan is not None and load_plan.restores_model
        loss_fn = build_loss_fn(cfg, self.dims.tp)
        built = build_model_parts(
            cfg, self.dims, self.model_args, self.env.device, loss_fn=loss_fn, init=not restores_weights
        )
        if restores_weights:
            for part in built.parts:
                part.init_buffers(self.env.device)  # buffers are not in checkpoints
        self.model_parts, self.pipeline = built.parts, built.pipeline
        self.float8 = built.float8
        self.lora = built.lora
        self.precompute_float8 = cfg.float8.precompute_float8_dynamic_scale_for_fsdp
        self.forward_backward = ForwardBackward(
            cfg, self.dims, self.model_parts, self.pipeline, self.env.device, loss_fn, bos_id=self.tokenizer.bos_id,
            chat=chat,
        )
        self.validator = (
            Validator(cfg.validation, validation_set, self.forward_backward, self.dims)
            if validation_set is not None else None
        )
        # A pipeline splits each of the loader's microbatches again.
        microbatches = self.loader.grad_accum_steps * (self.pipeline.n_microbatches if self.pipeline else 1)
        self.moe_balance = MoEBalance(self.model_parts, cfg.moe, self.model_args, self.dims, microbatches)
        self.microbatches = microbatches
        self.expert_load: dict[int, torch.Tensor] = {}
        self.optimizer = build_optimizer(self.model_parts, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.step = 0
        self.tokens_seen = 0
        self.checkpoint = self._build_checkpoint_manager()
        resumed = None
        if load_plan is not None:
            resumed = self.checkpoint.load(load_plan)  # before anything is written: a bad checkpoint changes nothing
            self.step, self.tokens_seen = resumed.step, resumed.tokens_seen
        self._first_row = self._announce_start(resumed)
        metrics_from = self.step
        if self.ft is not None:
            self.ft.attach(Trainable(
                self.model_parts, self.optimizer, self.lr_scheduler, self.loader,
                get_step=lambda: self.step, set_step=self._set_step,
            ))
            # A restarted group keeps the rows of the steps it trained before it went down.
            metrics_from = self.step or self.ft.restored_step

        compute_dtype = getattr(torch, cfg.training.mixed_precision_param)
        self.flops_per_token = flops_per_token(self.model_args, cfg.training.seq_len)
        self.peak_tflops = device_peak_tflops(self.env.device, compute_dtype, cfg.metrics.peak_tflops)
        self._said_peak_exceeded = False
        self.memory = MemoryMonitor(self.env.device)
        self.losses = StepLosses()
        self._open_sinks(metrics_from)

    def _open_sinks(self, metrics_from: int) -> None:
        """Rank 0's metrics.jsonl (rows after ``metrics_from`` superseded), TensorBoard and W&B sinks."""
        if self.env.rank != 0:
            return
        cfg = self.cfg
        note = run_folder.supersede_metrics(self.dump_folder, metrics_from)
        if note:
            self.say(note)
        tensorboard = self.dump_folder / cfg.metrics.save_tb_folder if cfg.metrics.enable_tensorboard else None
        self.sinks = MetricSinks(self.dump_folder, tensorboard_folder=tensorboard,
                                 wandb_config=dataclasses.asdict(cfg) if cfg.metrics.enable_wandb else None)

    def _global_batch(self, load_plan) -> int:
        """training.global_batch_size, or with -1 the resumed checkpoint's (so that a run restarted on
        fewer ranks keeps its batch, with more gradient accumulation), else local_batch_size x dp."""
        configured = self.cfg.training.global_batch_size
        if configured != -1:
            return configured
        load_plan = getattr(load_plan, "own", load_plan)  # a LoRA run's: its own step's
        if isinstance(load_plan, LoadPlan) and not load_plan.initial:
            saved = load_plan.meta.get("global_batch_size")
            if isinstance(saved, int) and not isinstance(saved, bool) and saved > 0:
                return saved
        return self.cfg.training.local_batch_size * self.dims.dp * self.groups

    def _announce_start(self, resumed) -> dict:
        """Say where this attempt starts; returns what the first metrics row records about it."""
        resumed_step = resumed.step if resumed is not None and not resumed.initial else None
        if not self.attempt.is_restart:
            return {} if resumed_step is None else {"resumed_from_step": resumed_step}
        restart = self.attempt.restart
        if resumed_step is None:
            self.console.print(
                f"[yellow]restart {restart}: the run has no checkpoint yet; starting again from step 0[/yellow]",
                soft_wrap=True,
            )
            return {"restart": restart}
        self.console.print(f"[yellow]resumed from step-{resumed_step} after restart {restart}[/yellow]", soft_wrap=True)
        return {"resumed_from_step": resumed_step, "restart": restart}

    def say(self, text: str) -> None:
        """Print plain text that may hold input (paths, the job description, lock contents): rich
        markup in it is shown, not applied, and control characters are made visible."""
        self.console.print(shown(text), soft_wrap=True)

    def parameters(self):
        return [p for part in self.model_parts for p in part.parameters()]

    def _set_step(self, step: int) -> None:
        """A healing replica group takes a live peer's step (never a smaller one: the Manager heals
        only a group behind the quorum)."""
        self.tokens_seen += (step - self.step) * self.global_batch * self.cfg.training.seq_len // self._data_ranks
        self.step = step

    @property
    def _data_ranks(self) -> int:
        return self.dims.dp * self.groups

    @property
    def _syncs_every_step(self) -> bool:
        return self.ft is not None and self.cfg.fault_tolerance.semi_sync_method == "none"

    def train_step(self) -> torch.Tensor | None:
        """One optimizer step over the global batch; records its loss and returns the grad norm, or
        None when a torchft replica group failed during the step (it is trained again).

        No host sync: the loss and the norm stay device tensors, read only on log steps
        (a GPU then runs ahead of Python instead of waiting for it every step).
        """
        ft = self.ft if self._syncs_every_step else None
        if ft is not None:
            ft.begin_step()  # may heal this group: a live peer's weights, optimizer state and step
            position = self.loader.state_dict()
        self.step_lr = self.lr_scheduler.get_last_lr()[0]  # after a heal: the peer's schedule
        for part in self.model_parts:  # a model whose training changes by step (an indexer's dense warm-up)
            set_step = getattr(part, "set_training_step", None)
            if set_step is not None:
                set_step(self.step, self.microbatches)
        loss_sum = self.forward_backward(self.loader.next_step())
        if ft is not None:
            loss_sum = ft.average_gradients(self.parameters(), loss_sum)
        grad_norm = clip_grad_norm(self.parameters(), self.cfg.training.max_norm, self.dims)
        if ft is not None and not ft.commit():
            self.loader.load_state_dict(position)  # its samples are trained again, with the live groups
            self.optimizer.zero_grad(set_to_none=True)
            return None
        self.losses.record(self.step + 1, loss_sum)
        self.checkpoint.wait_for_staging()  # an async save may still be copying the weights
        self.optimizer.step()
        self.expert_load = self.moe_balance.after_step()
        if self.precompute_float8:
            precompute_float8_scales(self.model_parts)
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def read_losses(self) -> float:
        """The last step's global loss (a host sync and collectives: every rank, same steps).
        Stops the run if any step since the last read had a non-finite loss."""
        loss, diverged = self.losses.read(self.dims)
        if diverged is not None:
            step, value = diverged
            lora = self.cfg.lora
            alpha = f", lora.alpha (now {lora.alpha:g}, scale {lora.alpha / lora.rank:g})" if lora.enable else ""
            raise TrainingDiverged(
                f"loss is {value} at step {step}; lower optimizer.lr "
                f"(now {self.cfg.optimizer.lr}){alpha} or raise lr_scheduler.warmup_steps"
            )
        return loss

    def _build_checkpoint_manager(self) -> CheckpointManager:
        return CheckpointManager(
            self.cfg,
            model_parts=self.model_parts,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            loader=self.loader,
            model_args=self.model_args,
            rank=self.env.rank,
            world_size=self.env.world_size,
            dp_degree=self.dims.dp,
            device=self.env.device,
            log=self.say,
            lora=self.lora,
            # A DiLoCo group's global weights and outer optimizer: semi_sync gets model_parts[0] too.
            extra_states=self.ft.checkpoint_states(self.model_parts[0]) if self.ft is not None else None,
        )

    def train(self) -> None:
        cause = "stopped by torchrun (SIGTERM: a rank failed, or a node left or joined)"
        announce = elastic.once(lambda: self._say_where_the_run_stands(cause))
        stop_on_sigterm = (
            elastic.sigterm_raises(announce if self.is_logging_rank else None)
            if self.env.distributed
            else contextlib.nullcontext()
        )
        try:
            with stop_on_sigterm:
                self._train()
        except elastic.Terminated:
            if self.is_logging_rank:
                announce()
            self.close()
            elastic.die_of_sigterm()
        except TitanError as e:
            if elastic.under_torchrun():
                elastic.record_failure(f"{e}; {self._where_the_run_stands()}")
            raise
        except BaseException as e:
            if self.env.distributed:
                line = self._say_where_the_run_stands(f"{type(e).__name__}: {_first_line(e)}")
                elastic.record_failure(line)
            raise
        finally:
            self.close()

    def _where_the_run_stands(self) -> str:
        """The newest complete checkpoint, and what torchrun does next."""
        steps = complete_checkpoints(self.checkpoint.root) if self.cfg.checkpoint.enable_checkpoint else {}
        newest = f"newest complete checkpoint: {list(steps.values())[-1]}" if steps else "no complete checkpoint"
        return f"{newest}; {self.attempt.after_failure()}" if elastic.under_torchrun() else newest

    def _say_where_the_run_stands(self, cause: str) -> str:
        line = (f"{hang_watchdog.who(self.env.rank)} stopped at step {self.step + 1}: {cause}; "
                f"{self._where_the_run_stands()}")
        print(f"[titanctl] {visible(line)}", file=sys.stderr, flush=True)  # the path and cause come from input
        return line

    def _train(self) -> None:
        cfg = self.cfg
        if cfg.checkpoint.create_seed_checkpoint:
            with self.checkpoint:
                folder = self.checkpoint.save_seed()
            self.say(f"seed checkpoint written to {folder}; not training (create_seed_checkpoint)")
            return
        n_params = num_params(self.model_args)
        if cfg.job.description:
            self.say(cfg.job.description)
        self.console.print(
            f"[bold]titanctl[/bold] {cfg.model.name} {cfg.model.flavor}: {n_params / 1e6:.1f}M params, "
            f"vocab {self.model_args.vocab_size}, layout {self.dims.describe()}, device {self.env.device}, "
            f"global batch {self.global_batch} x {cfg.training.seq_len} tokens, "
            f"{self.loader.grad_accum_steps} microbatch(es)/step",
            soft_wrap=True,
        )
        slow = slow_compute_note(self.env.device, getattr(torch, cfg.training.mixed_precision_param))
        if slow:
            self.console.print(f"[yellow]{slow}[/yellow]", soft_wrap=True)
        if self.lora is not None:
            self.say(self.lora.describe(n_params))
        if self.float8 is not None:
            self.console.print(self.float8.describe(), soft_wrap=True)
            note = emulation_note(self.env.device)
            if note:
                self.console.print(f"[yellow]{note}[/yellow]", soft_wrap=True)
        tokens_per_dp_rank = self.global_batch * cfg.training.seq_len // self._data_ranks
        progress = Progress(
            TextColumn("[bold blue]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.is_logging_rank or not self.console.is_terminal,
        )
        start_step = self.step
        profiling = maybe_profile(cfg, self.env.rank, self.dump_folder, start_step=self.step, log=self.say)
        semi_sync = (
            self.ft.semi_sync(self.model_parts[0])
            if self.ft is not None and not self._syncs_every_step else contextlib.nullcontext()
        )
        with self.checkpoint, progress, self._hang_watchdog() as watchdog, profiling as profiler, \
                automatic_gc_paused(), semi_sync as algorithm:
            if self.ft is not None and self.ft.rejoining:
                self.say(f"{self.ft.describe()}: restarted between syncs; joining the live groups' next sync")
                watchdog.timeout_s = cfg.comm.init_timeout_seconds  # the others may be a whole sync away
                with watchdog.watch(f"joining the next sync after step {self.ft.restored_step}"):
                    self.ft.rejoin(algorithm)
                self.ft.committed(self.step, keep_for_checkpoint=False)
                start_step = self.step  # the first step this process trains is the one after the sync
            task = progress.add_task("train", total=cfg.training.steps, completed=self.step, loss="-")
            # The process's first step (torch.compile, warm-up) is timed apart and left out of tps.
            window_start, window_steps, first_step_time = time.perf_counter(), 0, None
            while self.step < cfg.training.steps:
                # The first step of a process also compiles and warms up: it gets the init timeout.
                first = self.step == start_step
                if first:  # the longest silent phase of a run otherwise
                    self.say(self._first_step_announcement())
                watchdog.timeout_s = cfg.comm.init_timeout_seconds if first else cfg.comm.train_timeout_seconds
                with watchdog.watch(f"step {self.step + 1}"):
                    grad_norm = self.train_step()
                if grad_norm is None:  # not committed: a replica group failed; train it again with the live ones
                    continue
                lr = self.step_lr
                self.step += 1
                self.tokens_seen += tokens_per_dp_rank
                last = self.step == cfg.training.steps
                if self.ft is not None:
                    self.ft.committed(self.step, keep_for_checkpoint=self.checkpoint.should_save(self.step, last))
                validating = self.validator is not None and self.validator.due(self.step, last)
                log_step = self.step % cfg.metrics.log_freq == 0 or last or validating  # val_loss needs a row
                if first:
                    first_step_time = self._first_step_done(window_start, log_step)
                    window_start = time.perf_counter()
                else:
                    window_steps += 1
                if log_step or self.checkpoint.should_save(self.step, last):
                    # The loop's only host syncs; a checkpoint never holds weights a NaN reached.
                    with watchdog.watch(f"step {self.step} (metrics)"):
                        loss = self.read_losses()
                        seconds = time.perf_counter() - window_start  # the window ends before validation
                    validation = self._validate(watchdog) if validating else {}
                    if log_step:
                        with watchdog.watch(f"step {self.step} (metrics)"):  # _log may gather over ranks
                            self._log(loss, grad_norm, lr, seconds, window_steps, first_step_time, validation)
                        window_start, window_steps = time.perf_counter(), 0
                        progress.update(task, loss=f"{loss:.4f}")  # the bar shows the last logged loss
                progress.update(task, advance=1)
                if self.ft is None or self.ft.is_lowest_live():  # one group writes the job's checkpoints
                    self.checkpoint.maybe_save(self.step, self.tokens_seen, last=last)
                profiler.step()
                if self.step % cfg.training.gc_freq == 0:
                    gc.collect(1)
        self.console.print(f"done: {self.step} steps, {self.tokens_seen:,} tokens per data-parallel rank")

    @contextlib.contextmanager
    def _hang_watchdog(self):
        """In a distributed run with the Flight Recorder on, dump it when a step outlives
        comm.train_timeout_seconds (gloo never dumps by itself) or raises, so that
        `titanctl inspect-trace` can say which rank is stuck where."""
        if not self.env.distributed or self.cfg.comm.trace_buf_size == 0:
            yield _NoWatchdog()
            return
        dump = hang_watchdog.DumpOnce(self.flight_recorder_folder, self.env.rank)
        timed_out = hang_watchdog.DumpOnce(
            self.flight_recorder_folder, self.env.rank, exit_code=3,
            before_exit=lambda reason: elastic.record_failure(self._say_where_the_run_stands(reason)),
        )
        watchdog = hang_watchdog.CollectiveWatchdog(self.cfg.comm.train_timeout_seconds, timed_out)
        try:
            yield watchdog
        except BaseException as e:
            dump(f"{type(e).__name__} at step {self.step + 1}")
            raise
        finally:
            watchdog.close()

    def _validate(self, watchdog) -> dict:
        """Evaluate on the validation set (each batch watched like a step); say it in one line."""
        result = self.validator.run(self.step, watchdog.watch)
        self.say(result.describe())
        return result.metrics()

    def _first_step_done(self, started: float, log_step: bool) -> float:
        """Seconds of the process's first step (compile, warm-up), begun at ``started``: said once
        (by its log row, if it has one), kept out of tps."""
        if self.env.device.type == "cuda":
            torch.cuda.synchronize()  # once: the step's queued kernels belong to it, not to the next window
        seconds = time.perf_counter() - started
        if not log_step:  # a log row would say it
            self.console.print(self._first_step_text(seconds), soft_wrap=True)
        return seconds

    def _first_step_announcement(self) -> str:
        step = f"step {self.step + 1}"
        if not self.cfg.compile.enable:
            return f"{step}: warming up..."
        blocks = sum(len(part.layers) for part in self.model_parts)
        return (f"{step}: compiling {blocks} blocks with torch.compile (once per process; inductor's cache "
                "makes the next runs faster)...")

    def _first_step_text(self, seconds: float) -> str:
        what = "torch.compile and warm-up" if self.cfg.compile.enable else "warm-up"
        return f"first step {seconds:.2f} s ({what}; not counted in tps)"

    def _log(
        self, loss: float, grad_norm: torch.Tensor, lr: float, seconds: float, steps: int,
        first_step_time: float | None = None, validation: dict | None = None,
    ) -> None:
        """One metrics row for the ``steps`` steps that took ``seconds`` (wall time up to a host sync);
        ``validation``: the step's val_loss and val_perplexity, when it validated.

        ``steps`` = 0: the window held only the process's first step, which took ``first_step_time``:
        the row gives that time as step_time and no rates (they would count compile and warm-up).
        """
        grad_norm = grad_norm.item()
        rate = None
        if steps:
            rate = throughput(
                self.global_batch * self.cfg.training.seq_len, steps, seconds, self.dims.world_size,
                self.flops_per_token, self.peak_tflops,
            )
        memory = self.memory.read()
        # Every rank joins: under pipeline parallel the MoE layers live on different stages.
        expert_load = gather_over_pipeline(self.expert_load, self.dims) if self.model_args.moe else {}
        moe = load_metrics(expert_load) if expert_load else {}
        # Multi-token prediction: the last step's mean over depths (collectives: every rank reads it).
        mtp_loss = None
        if self.model_args.mtp_layers:
            mtp_loss = global_mean_loss(self.forward_backward.mtp_loss, self.dims).item()
        # The last step's, on this rank's CP group (its peers hold the same microbatches, so every rank of it
        # computes the same numbers, with no collective).
        cp_work = self.forward_backward.cp_work
        cp = {} if cp_work is None else {"cp_imbalance": round(imbalance(cp_work), 4)}
        row = {
            "step": self.step,
            "loss": loss,
            **({} if mtp_loss is None else {"mtp_loss": mtp_loss}),
            "grad_norm": grad_norm,
            "lr": lr,
            "tps": None if rate is None else round(rate.tps, 1),
            # 4 significant digits: CPU runs are far below 1
            "tflops": None if rate is None else float(f"{rate.tflops:.4g}"),
            "mfu": None if rate is None or rate.mfu is None else round(rate.mfu, 3),
            "step_time": round(first_step_time if rate is None else rate.step_time, 6),
            **memory,
            "tokens_seen": self.tokens_seen,
            "tokens_by_source": self.loader.tokens_by_source(),
            **(validation or {}),
            **moe,
            **cp,
            **self._first_row,  # where this attempt started, on its first row only
            **(self.ft.metrics() if self.ft is not None else {}),
        }
        self._first_row = {}
        if self.sinks is not None:
            self.sinks.log(row, histograms={f"expert_load/layer_{i}": c for i, c in expert_load.items()})
        memory_text = f"memory {memory['memory_gib']:6.2f} GiB"
        if "memory_reserved_pct" in memory:
            memory_text += f" ({memory['memory_reserved_pct']:.0f}%)"
            if memory["num_alloc_retries"] or memory["num_ooms"]:
                memory_text += (
                    f" [yellow]{memory['num_alloc_retries']} alloc retries, {memory['num_ooms']} OOMs[/yellow]"
                )
        if rate is not None and rate.mfu is None and self.peak_tflops and not self._said_peak_exceeded:
            self._said_peak_exceeded = True
            self.console.print(
                f"[yellow]mfu not shown: {rate.tflops:.4g} TFLOP/s per device exceeds the peak of "
                f"{self.peak_tflops:.4g} (a clock the OS reports below the real one?); set "
                "metrics.peak_tflops to the device's peak[/yellow]",
                soft_wrap=True,
            )
        if rate is None:
            rate_text = self._first_step_text(first_step_time)
        else:
            mfu_text = "n/a" if rate.mfu is None else f"{rate.mfu:.2f}%"
            rate_text = f"tps {rate.tps:>9,.0f}  tflops {rate.tflops:7.3f}  mfu {mfu_text:>6}"
        self.console.print(
            f"step {self.step:>6}  loss {loss:8.4f}  " + ("" if mtp_loss is None else f"mtp_loss {mtp_loss:8.4f}  ")
            + f"grad_norm {grad_norm:7.3f}  lr {lr:.2e}  "
            f"{rate_text}  {memory_text}" + (f"  experts max/mean {moe['expert_imbalance_max']:.2f}" if moe else "")
            + (f"  cp max/mean {cp['cp_imbalance']:.3f}" if cp else "")
            + (_replica_text(row, self.groups) if self.ft is not None else ""),
            soft_wrap=True,
        )


class _NoWatchdog:
    @contextlib.contextmanager
    def watch(self, label: str = ""):
        yield self


def _replica_text(row: dict, groups: int) -> str:
    """torchft: the live replica groups of the step, and a heal when this group just took a peer's state."""
    text = (f"  replicas {row['live_replicas']}/{groups} ({row['participating_ranks']} ranks)  "
            f"lost steps {row['lost_steps']}")
    if "heal_seconds" in row:
        text += (f"  [yellow]healed from a live peer in {row['heal_seconds']:.2f} s after missing "
                 f"{row['missed_steps']} steps[/yellow]")
    return text


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"

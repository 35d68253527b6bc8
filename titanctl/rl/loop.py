"""The RL loop: rollout, rewards, advantages, policy updates, metrics, checkpoints.

It is the Trainer's shell (process group, dump folder, hang watchdog, SIGTERM, errors) around its own
step, built from the shared core: the same model build and layout, optimizer, LR schedule, gradient
clipping, checkpoint manager and metric sinks. A step of ``training.steps`` is one policy update; every
``rl.updates_per_rollout`` of them share a rollout, sampled by the policy itself (titanctl.rl.rollout).
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from titanctl.checkpoint.run.manager import CheckpointManager, plan_load
from titanctl.checkpoint.run.state import ModelState
from titanctl.config.job_config import JobConfig
from titanctl.errors import ConfigError, DataError, TrainingDiverged
from titanctl.gc_pauses import automatic_gc_paused
from titanctl.models.shapes import num_params
from titanctl.parallel.converters.lora import LoRAGroupedExperts, LoRALinear
from titanctl.parallel.layouts.build import build_model_parts, check_layout
from titanctl.parallel.layouts.reductions import clip_grad_norm
from titanctl.parallel.runtime.env import use_deterministic_algorithms
from titanctl.rl import advantages as adv
from titanctl.rl.batch_invariant import BatchInvariant
from titanctl.rl.layouts import check_rl_layout, gathered
from titanctl.rl.prompts import PromptLoader, PromptSet
from titanctl.rl.rewards import build_rewards, score
from titanctl.rl.rollout import Sampler, row_keys
from titanctl.rl.update import Batch, PolicyUpdate
from titanctl.train.lr_schedule import build_lr_scheduler
from titanctl.train.metrics import MemoryMonitor
from titanctl.train.optim import build_optimizer
from titanctl.train.trainer import Trainer


def check_rl_keys(cfg: JobConfig) -> None:
    """Relations between keys that need no model (one line each)."""
    rl = cfg.rl
    for key, on in (("fault_tolerance.enable", cfg.fault_tolerance.enable),
                    ("float8.enable_float8_linear", cfg.float8.enable_float8_linear),
                    ("checkpoint.create_seed_checkpoint", cfg.checkpoint.create_seed_checkpoint)):
        if on:
            raise ConfigError(f"{key} = true is not for titanctl rl, which samples and trains one model in "
                              "training.mixed_precision_param, as one replica group, from a checkpoint; unset it")
    if cfg.training.steps % rl.updates_per_rollout:
        raise ConfigError(f"config key 'training.steps' = {cfg.training.steps} must be a multiple of "
                          f"rl.updates_per_rollout = {rl.updates_per_rollout}: a run ends with its last rollout's "
                          "last update")
    if cfg.checkpoint.enable_checkpoint and cfg.checkpoint.interval % rl.updates_per_rollout:
        raise ConfigError(f"config key 'checkpoint.interval' = {cfg.checkpoint.interval} must be a multiple of "
                          f"rl.updates_per_rollout = {rl.updates_per_rollout}: a checkpoint lies between rollouts")
    if rl.overlong_buffer_tokens > rl.max_response_tokens:
        raise ConfigError(f"config key 'rl.overlong_buffer_tokens' = {rl.overlong_buffer_tokens} exceeds "
                          f"rl.max_response_tokens = {rl.max_response_tokens}")
    if rl.epsilon_high is not None and rl.epsilon_high < rl.epsilon:
        raise ConfigError(f"config key 'rl.epsilon_high' = {rl.epsilon_high} is below rl.epsilon = {rl.epsilon}: "
                          "clip-higher raises the upper bound")
    if rl.max_response_tokens >= cfg.training.seq_len:
        raise ConfigError(f"config key 'rl.max_response_tokens' = {rl.max_response_tokens} leaves no room for a "
                          f"prompt within training.seq_len = {cfg.training.seq_len}, the model's positions")


@contextmanager
def adapters_off(model: torch.nn.Module):
    """The LoRA policy as its frozen base: every adapter's scale 0 (base + 0 is the base, bit for bit)."""
    adapted = [m for m in model.modules() if isinstance(m, (LoRALinear, LoRAGroupedExperts))]
    scales = [m.lora_scale for m in adapted]
    for m in adapted:
        m.lora_scale = 0.0
    try:
        yield
    finally:
        for m, scale in zip(adapted, scales):
            m.lora_scale = scale


class RLTrainer(Trainer):
    """One RL run: built by ``__init__`` (which owns the dump folder from then on), run once by ``train``."""

    sampler: Sampler | None = None

    def _check_config(self) -> None:
        """RL's keys and the layouts it samples under, then the layout as training builds it (on every rank
        before it joins the process group: Trainer._preflight)."""
        check_rl_keys(self.cfg)
        check_rl_layout(self.cfg, self.dims, self.model_args)
        check_layout(self.cfg, self.dims, self.model_args)

    def _build(self) -> None:
        cfg, rl = self.cfg, self.cfg.rl
        torch.manual_seed(cfg.training.seed)
        if cfg.training.deterministic:
            use_deterministic_algorithms(self.env.device)
        self.prompts = PromptSet(rl, self.tokenizer, cfg.training.seq_len, cfg.sft.chat_template_path)
        self.rewards = build_rewards(rl)
        load_plan = plan_load(cfg, self.model_args)
        dp_mesh = self.dims.mesh_for("dp_replicate", "dp_shard") if self.dims.dp > 1 else None
        self._dp_group = dp_mesh.get_group() if dp_mesh is not None else None
        self.dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0
        self.loader = PromptLoader(self.prompts, rl.prompts_per_step, cfg.training.seed, rl.group_size)
        self.global_batch = self.loader.global_batch_size
        self.say(f"rl prompts {self.prompts.description}: {len(self.prompts):,} rows; {rl.prompts_per_step} "
                 f"prompts x {rl.group_size} completions a "
                 f"rollout, up to {rl.max_response_tokens} tokens each")

        restores = load_plan is not None and load_plan.restores_model
        built = build_model_parts(cfg, self.dims, self.model_args, self.env.device, init=not restores,
                                  sequence_parallel=False)
        if restores:
            for part in built.parts:
                part.init_buffers(self.env.device)
        self.model_parts, self.pipeline, self.lora, self.float8 = built.parts, None, built.lora, built.float8
        self.model = self.model_parts[0]
        self.reference = None
        extra = {}
        if rl.kl_coef and self.lora is None:  # with LoRA the base is the reference
            frozen = build_model_parts(cfg, self.dims, self.model_args, self.env.device, init=False,
                                       sequence_parallel=False)
            self.reference = frozen.parts[0].requires_grad_(False).eval()
            self.reference.init_buffers(self.env.device)
            extra["reference"] = ModelState([self.reference])
        self.optimizer = build_optimizer(self.model_parts, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.step, self.tokens_seen = 0, 0
        self.checkpoint = CheckpointManager(
            cfg, model_parts=self.model_parts, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            loader=self.loader, model_args=self.model_args, rank=self.env.rank, world_size=self.env.world_size,
            dp_degree=self.dims.dp, device=self.env.device, log=self.say, lora=self.lora, extra_states=extra,
        )
        resumed = self.checkpoint.load(load_plan) if load_plan is not None else None
        if resumed is not None:
            self.step, self.tokens_seen = resumed.step, resumed.tokens_seen
        if self.reference is not None and (resumed is None or "reference" not in resumed.loaded):
            extra["reference"].load_state_dict(ModelState(self.model_parts).state_dict())  # the run's start
        self._first_row = self._announce_start(resumed)

        compute_dtype = getattr(torch, cfg.training.mixed_precision_param)
        autocast = compute_dtype != torch.float32 and not self.dims.fsdp_enabled
        key_length = cfg.training.seq_len

        def forward_context():
            mode = BatchInvariant(key_length) if rl.batch_invariant else nullcontext()
            cast = torch.autocast(self.env.device.type, dtype=compute_dtype) if autocast else nullcontext()
            return _both(cast, mode)

        vocab = min(self.tokenizer.vocab_size, self.model_args.vocab_size)
        pad = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else self.tokenizer.eos_id
        self.sampler = Sampler(
            self.model, batch=rl.prompts_per_step // self.dims.dp * rl.group_size, key_length=key_length,
            stop_tokens=self.prompts.stop_tokens, vocab=vocab, temperature=rl.temperature, pad_id=pad,
            forward_context=forward_context, compile=rl.compile_sampler, record_routes=rl.routing_replay,
            finished=self._all_done if self.dims.ep > 1 else None, dtype=compute_dtype, tp=self.dims.tp,
        )
        self.update = PolicyUpdate(
            rl, self.model, cfg.training.local_batch_size, vocab, self._sum, self.dims.dp, forward_context,
            reference=self.reference, adapters_off=(lambda: adapters_off(self.model)) if self.lora else None,
            recorder=self.sampler.recorder,
        )
        self.memory = MemoryMonitor(self.env.device)
        self._open_sinks(self.step)

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
        super().close()

    # ------------------------------------------------------------------ reductions over the data-parallel ranks

    def _sum(self, value: torch.Tensor) -> torch.Tensor:
        if self._dp_group is None:
            return value
        value = value.detach().clone()
        dist.all_reduce(value, group=self._dp_group)
        return value

    def _max(self, value: torch.Tensor) -> torch.Tensor:
        if self._dp_group is None:
            return value
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._dp_group)
        return value

    def _all_done(self, done: torch.Tensor) -> bool:
        """Every data-parallel rank's rows are done (expert parallelism: ranks decode in step)."""
        return bool(self._sum((~done).sum()) == 0)

    def _agree(self, error: str | None) -> None:
        """Every rank stops with the first rank's error, or none does (a rank alone would leave the others
        waiting in a collective)."""
        if self._dp_group is not None:
            errors = [None] * self.dims.dp
            dist.all_gather_object(errors, error, group=self._dp_group)
            error = next((e for e in errors if e), None)
        if error:
            raise DataError(error)

    # ------------------------------------------------------------------ one rollout

    def rollout(self, index: int) -> tuple[Batch, dict[str, float]]:
        """Sample, score and weigh this rank's share of rollout ``index``'s prompts."""
        rl = self.cfg.rl
        rows = self.loader.next_step()
        share = rl.prompts_per_step // self.dims.dp
        first = self.dp_rank * share
        try:
            mine, error = [self.prompts[i] for i in rows[first:first + share]], None
        except DataError as e:  # a prompt past the model's positions, rendered now
            error = str(e)
        self._agree(error)
        keys = row_keys(self.cfg.training.seed, index, range(first, first + share), rl.group_size)
        with gathered(self.model, self.cfg):
            sampled = self.sampler.sample([p.ids for p in mine for _ in range(rl.group_size)], keys,
                                          rl.max_response_tokens)
        stops = set(self.prompts.stop_tokens)
        rewards, error = torch.zeros(sampled.tokens.shape[0]), None
        try:
            for row in range(rewards.shape[0]):
                prompt = mine[row // rl.group_size]
                text = self.tokenizer.decode([t for t in sampled.response(row) if t not in stops])
                rewards[row] = score(self.rewards, prompt.text, text, prompt.answer,
                                     f"{prompt.where} of rl.dataset {self.prompts.description}")
        except DataError as e:
            error = str(e)
        self._agree(error)
        rewards = rewards + adv.overlong_penalty(sampled.response_lengths.cpu(), rl.max_response_tokens,
                                                 rl.overlong_buffer_tokens, rl.overlong_penalty)
        groups = rewards.view(-1, rl.group_size)
        spread = adv.batch_std(rewards, self._sum) if rl.scale_rewards == "batch" else None
        advantages = adv.group_advantages(groups, rl.scale_rewards, spread).flatten()
        kept = adv.kept_groups(groups) if rl.dynamic_sampling else torch.ones(groups.shape[0], dtype=torch.bool)
        counted = sampled.response_lengths.cpu()[:, None] > torch.arange(rl.max_response_tokens)
        mask = (counted & kept.repeat_interleave(rl.group_size)[:, None]).float()
        device = self.env.device
        batch = Batch(sampled.tokens, sampled.prompt_lengths, sampled.response_lengths, sampled.logprobs,
                      mask.to(device), advantages.to(device), sampled.routes)
        totals = self._sum(torch.stack([
            rewards.sum(), (rewards >= rl.pass_threshold).float().sum(), torch.tensor(float(rewards.numel())),
            sampled.response_lengths.cpu().float().sum(), (~sampled.stopped.cpu()).float().sum(),
            kept.float().sum(), torch.tensor(float(groups.shape[0])), torch.tensor(sampled.seconds),
        ]))
        count = totals[2]
        stats = {
            "reward_mean": (totals[0] / count).item(),
            "reward_std": adv.batch_std(rewards, self._sum).item(),
            "pass_rate": (totals[1] / count).item(),
            "response_length": (totals[3] / count).item(),
            "truncated": (totals[4] / count).item(),
            "groups_kept": (totals[5] / totals[6]).item(),
            "generated_tokens": int(totals[3].item()),
            "generation_seconds": self._max(torch.tensor(sampled.seconds)).item(),
        }
        return batch, stats

    # ------------------------------------------------------------------ the loop

    def _train(self) -> None:
        cfg, rl = self.cfg, self.cfg.rl
        n_params = num_params(self.model_args)
        if cfg.job.description:
            self.say(cfg.job.description)
        self.console.print(
            f"[bold]titanctl rl[/bold] {cfg.model.name} {cfg.model.flavor}: {n_params / 1e6:.1f}M params, layout "
            f"{self.dims.describe()}, device {self.env.device}; loss {rl.loss_type}, advantages "
            f"{rl.scale_rewards}-scaled, ratio per {rl.importance_sampling_level}"
            + (", batch-invariant kernels" if rl.batch_invariant else ""), soft_wrap=True)
        if self.lora is not None:
            self.say(self.lora.describe(n_params))
        batch, rollout_stats = None, {}
        with self.checkpoint, self._hang_watchdog() as watchdog, automatic_gc_paused():
            while self.step < cfg.training.steps:
                watchdog.timeout_s = cfg.comm.train_timeout_seconds if batch is not None else \
                    cfg.comm.init_timeout_seconds
                started = time.perf_counter()
                if self.step % rl.updates_per_rollout == 0:
                    with watchdog.watch(f"rollout for step {self.step + 1}"):
                        batch, rollout_stats = self.rollout(self.step // rl.updates_per_rollout)
                    update_started = time.perf_counter()
                else:
                    update_started = started
                lr = self.lr_scheduler.get_last_lr()[0]
                with watchdog.watch(f"step {self.step + 1}"):
                    sums = self.update(batch)
                    grad_norm = clip_grad_norm(self.parameters(), cfg.training.max_norm, self.dims)
                    self.optimizer.step()
                    self.lr_scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                trained = int((batch.prompt_lengths + batch.response_lengths).sum())
                self.tokens_seen += trained
                last = self.step == cfg.training.steps
                if self.step % cfg.metrics.log_freq == 0 or last:
                    with watchdog.watch(f"step {self.step} (metrics)"):
                        self._log_rl(batch, sums, rollout_stats, grad_norm, lr, trained,
                                     time.perf_counter() - update_started, time.perf_counter() - started)
                self.checkpoint.maybe_save(self.step, self.tokens_seen, last=last)
                if self.step % cfg.training.gc_freq == 0:
                    gc.collect(1)
        self.console.print(f"done: {self.step} policy updates")

    def _log_rl(self, batch: Batch, sums: dict, rollout: dict, grad_norm: torch.Tensor, lr: float, trained: int,
                update_seconds: float, step_seconds: float) -> None:
        rl = self.cfg.rl
        stats = batch.stats
        totals = self._sum(torch.stack([
            sums["loss"], sums["low_clipped"].float(), sums["high_clipped"].float(), sums["kl"].float(),
            batch.mask.sum(), stats["entropy"].float(), stats["logprob_diff_sum"].float(),
            stats["kl_sampler_trainer_sum"].float(), stats["scored_tokens"], torch.tensor(float(trained)),
        ]))
        tokens, scored = totals[4].clamp(min=1), totals[8].clamp(min=1)
        loss = totals[0].item()
        if not torch.isfinite(totals[0]):
            raise TrainingDiverged(f"loss is {loss} at step {self.step}; lower optimizer.lr (now "
                                   f"{self.cfg.optimizer.lr}) or raise lr_scheduler.warmup_steps")
        world = self.dims.world_size
        first_update = self.step % rl.updates_per_rollout == 1 or rl.updates_per_rollout == 1
        row = {
            "step": self.step,
            "loss": loss,
            "grad_norm": grad_norm.item(),
            "lr": lr,
            **{k: rollout[k] for k in ("reward_mean", "reward_std", "pass_rate", "response_length", "truncated",
                                       "groups_kept")},
            "clip_fraction": ((totals[1] + totals[2]) / tokens).item(),
            "clip_low": (totals[1] / tokens).item(),
            "clip_high": (totals[2] / tokens).item(),
            "kl": (totals[3] / tokens).item() if rl.kl_coef else None,
            "entropy": (totals[5] / tokens).item(),
            "logprob_diff_max": self._max(stats["logprob_diff_max"].float()).item(),
            "logprob_diff_mean": (totals[6] / scored).item(),
            "kl_sampler_trainer": (totals[7] / scored).item(),
            "generation_tps": round(rollout["generated_tokens"] / max(rollout["generation_seconds"], 1e-9) / world, 1)
            if first_update else None,
            "training_tps": round(totals[9].item() / max(update_seconds, 1e-9) / world, 1),
            "step_time": round(step_seconds, 4),
            **self.memory.read(),
            "tokens_seen": self.tokens_seen,
            **self._first_row,
        }
        self._first_row = {}
        if self.sinks is not None:
            self.sinks.log(row)
        gen = "" if row["generation_tps"] is None else f"  gen {row['generation_tps']:,.0f} tok/s"
        kl = "" if row["kl"] is None else f"  kl {row['kl']:.4f}"
        self.console.print(
            f"step {self.step:>5}  reward {row['reward_mean']:.3f} ± {row['reward_std']:.3f}  pass "
            f"{row['pass_rate']:.0%}  len {row['response_length']:.1f}  loss {loss:8.4f}{kl}  entropy "
            f"{row['entropy']:.3f}  clip {row['clip_fraction']:.3f}  logprob_diff_max {row['logprob_diff_max']:.2e}"
            f"{gen}  train {row['training_tps']:,.0f} tok/s", soft_wrap=True)


@contextmanager
def _both(first, second):
    with first, second:
        yield

"""Distributed checkpoints of a training run: save, resume, async writes, retention, atomicity.

Folder layout (``root = {job.dump_folder}/{checkpoint.folder}``)::

    root/step-{N}/            a complete checkpoint (plain DCP + titanctl.json + config.toml)
    root/step-{N}-hf/         a Hugging Face model folder (checkpoint.save_format, last_save_in_hf):
                              weights only, never resumed from (``titanctl.checkpoint.run.hf_save``)
    root/.tmp-step-{N}/       a save in progress; never loaded, removed by the next save
    root/.tmp-step-{N}-hf/    the same for a Hugging Face save
    root/.trash-*/            a checkpoint being deleted (retention); never loaded

A save writes into ``.tmp-step-{N}``; when every rank has written its files (DCP's
coordinator writes ``.metadata`` only after that) rank 0 adds ``titanctl.json`` and
``config.toml`` and renames the folder to ``step-{N}``, then applies retention. A crash at
any moment therefore leaves earlier ``step-*`` folders intact, and a ``step-*`` folder is
complete by construction. Retention first renames a folder away, then deletes it, so a
half-deleted checkpoint never looks complete either. It keeps the newest ``keep_latest_k``
DCP steps and, counted apart, the newest ``keep_latest_k`` Hugging Face saves.

The DCP state dict follows ``titanctl.checkpoint.trust.metadata``: the model's canonical FQNs at
the top level, plus ``optimizer`` (flattened FQN keys, so it reshards across layouts),
``lr_scheduler``, ``dataloader``, ``train_state`` (step, tokens_seen) and ``rng``, and a DiLoCo run's
``diloco`` (``extra_states``). Each part is a ``Stateful`` (``titanctl.checkpoint.run.state``); the manager
builds one dict of them and hands it to DCP, for saves and loads alike.

Integrity: every rank hashes the files it wrote and rank 0 records the checksums in
``titanctl.json`` before the rename (``titanctl.checkpoint.trust.checksums``). A load reads the
folder through ``titanctl.checkpoint.trust.reader`` (no pickle outside an allow-list) and verifies
the checksums before any tensor is used; a damaged newest step of the run's own folder is
replaced by the newest older one that verifies (``titanctl.checkpoint.run.load_plan``).

LoRA runs (``lora.enable``) save and resume their adapters and the model's saved buffers only, with
the optimizer, schedule, data position and step; each step's ``titanctl.json`` records the adapters and
their frozen base under ``lora`` (``titanctl.checkpoint.lora.base``), whose weights a start or resume
loads first from the base's own checkpoint, after checking its fingerprint.

Async saves (``checkpoint.async_mode``) stage a CPU copy, then write in a background
thread on their own gloo process group (async DCP on the default group deadlocked). The
next training step does not wait for storage; the next save, and the end of training
(also on an exception), wait for the outstanding one.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import shutil
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful

from titanctl.checkpoint.hf.carried_config import HF_CONFIG_KEY
from titanctl.checkpoint.hf.names import HF_FILES_KEY
from titanctl.checkpoint.hf.serving_kernels import serving_warning
from titanctl.checkpoint.hf.uncarried import check_hf_saves
from titanctl.checkpoint.lora.base import LORA_KEY, LoRAPlan, base_record, check_same_base
from titanctl.checkpoint.run.carried import CarriedTensors
from titanctl.checkpoint.run.hf_save import hf_folder_name, hf_saves, run_tokenizer, write_hf_folder
from titanctl.checkpoint.run.load_into_model import load_source_into
from titanctl.checkpoint.run.load_plan import (
    STATE_PARTS,
    STEP_FOLDER,
    ForeignPlan,
    LoadPlan,
    check_config,
    check_model,
    complete_checkpoints,
    fallback_note,
    plan_load,
    resolve_checkpoint_path,
)
from titanctl.checkpoint.run.state import (
    LoaderState,
    ModelState,
    OptimizerState,
    RNGState,
    SchedulerState,
    TrainState,
)
from titanctl.checkpoint.trust.checksums import ChecksumWriter, digest_files, gather_checksums, record
from titanctl.checkpoint.trust.metadata import RUN_CONFIG, write_metadata
from titanctl.checkpoint.trust.reader import DCP_INDEX, first_failure, one_line, quiet_dcp
from titanctl.config.job_config import JobConfig
from titanctl.config.recipe import to_toml
from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH
from titanctl.errors import CheckpointCorrupt, CheckpointError, ConfigError, TitanError
from titanctl.models.common.args import ModelArgs
from titanctl.models.shapes import tied_weights
from titanctl.parallel.converters.lora import LoRAConversion, is_adapter
from titanctl.parallel.layouts.weight_init import canonical_name
from titanctl.parallel.runtime import peers

TMP_PREFIX = ".tmp-step-"
TRASH_PREFIX = ".trash-"

__all__ = [
    "STATE_PARTS", "STEP_FOLDER", "CheckpointManager", "LoadPlan", "Resumed", "check_config", "check_model",
    "complete_checkpoints", "plan_load", "resolve_checkpoint_path",
]


@dataclasses.dataclass
class Resumed:
    """What a load restored."""

    folder: Path
    step: int
    tokens_seen: int
    loaded: tuple[str, ...]  # which of STATE_PARTS
    initial: bool  # from checkpoint.initial_load_path rather than the run's own folder


@dataclasses.dataclass
class SaveTiming:
    step: int
    blocking_s: float  # how long training waited for this save
    durable_s: float | None = None  # from the call until step-{N} existed (None: not yet)


@dataclasses.dataclass
class _Pending:
    """An async save in flight."""

    step: int
    tmp: Path
    meta: dict[str, Any]
    writer: ChecksumWriter
    started: float
    upload: Future
    staging: Future | None
    timing: SaveTiming
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: BaseException | None = None


class CheckpointManager:
    """Saves and restores one run's training state; every rank builds one, at the same point."""

    def __init__(
        self,
        cfg: JobConfig,
        *,
        model_parts: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        loader: Any,
        model_args: ModelArgs,
        rank: int,
        world_size: int,
        dp_degree: int,
        device: torch.device,
        log: Callable[[str], None] = print,
        lora: LoRAConversion | None = None,
        extra_states: dict[str, Stateful] | None = None,
    ) -> None:
        self.cfg = cfg
        self.ck = ck = cfg.checkpoint
        self.root = Path(cfg.job.dump_folder) / ck.folder
        self.loader = loader
        self.model_args = model_args
        self.rank, self.world_size, self.dp_degree = rank, world_size, dp_degree
        self.device = device
        self.log = log
        self.timings: list[SaveTiming] = []
        self._pending: _Pending | None = None
        # The Hugging Face config.json the weights came from (set by load): kept in every DCP step and
        # written back by Hugging Face saves (titanctl.checkpoint.hf.carried_config); likewise that
        # folder's files, which Hugging Face saves and exports of the steps write again (formats.hf).
        self.hf_config: dict[str, Any] | None = None
        self.hf_files: dict[str, Any] | None = None
        # That folder's tensors that are no part of the model (a vision-language folder's vision encoder and
        # prediction head): carried unchanged into the DCP steps and Hugging Face saves (run.carried).
        self.carried = CarriedTensors(rank)

        check_config(cfg)
        if ck.async_mode == "async_with_pinned_mem" and device.type != "cuda":
            raise ConfigError(
                "checkpoint.async_mode = 'async_with_pinned_mem' stages into pinned host memory, which needs a "
                f"CUDA device (this run is on {device.type}); use async_mode = 'async'"
            )
        if world_size == 1:
            # DCP warns on every single-process save, also from its async writer thread, where a
            # scoped filter does not reach: one process is the intent here, not an accident.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        self.saving = ck.enable_checkpoint or ck.create_seed_checkpoint
        # Hugging Face saves carry the run's tokenizer: checked now rather than after the last step.
        writes_hf = ck.enable_checkpoint and (ck.save_format != "dcp" or ck.last_save_in_hf)
        if writes_hf:
            check_hf_saves(cfg.moe.load_balance_coeff, model_args)
        self._hf_tokenizer = run_tokenizer(cfg.model.tokenizer_path, model_args) if writes_hf else None
        if writes_hf and (unservable := serving_warning(model_args)):
            self.log(f"warning: the run's Hugging Face saves: {unservable}")
        self.async_mode = ck.async_mode if ck.enable_checkpoint else "disabled"
        # The run's state, one Stateful per part of STATE_PARTS: what DCP saves and loads. A LoRA run's
        # model state is its adapters and saved buffers; its frozen base (``weights``) is only loaded.
        self.lora = lora
        self.lora_base: dict[str, str] | None = None  # the base's record, once loaded
        self.model = ModelState(model_parts)
        self.weights = self.model  # what an initial checkpoint (a LoRA run's base) restores
        if lora is not None:
            buffers = {canonical_name(name) for part in model_parts for name, _ in part.named_buffers()}
            self.model = ModelState(model_parts, keep=lambda key: is_adapter(key) or key in buffers)
            self.weights = ModelState(model_parts, keep=lambda key: not is_adapter(key))
        self.train_state = TrainState(dp_degree)
        self.states: dict[str, Stateful] = {
            "model": self.model,
            "optimizer": OptimizerState(self.model, optimizer),
            "lr_scheduler": SchedulerState(lr_scheduler),
            "dataloader": LoaderState(loader),
            "train_state": self.train_state,
            "rng": RNGState(rank, device),
            **(extra_states or {}),  # parts of STATE_PARTS that only some runs have
        }
        self._pg = None
        if world_size > 1 and (self.saving or ck.initial_load_path):
            # Every collective of checkpointing runs here: async writes overlap training's own
            # collectives on the default group, which deadlocked when they shared it.
            with peers.connecting():
                self._pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=30))
        self._stager = None
        if self.async_mode != "disabled":
            pinned = self.async_mode == "async_with_pinned_mem"
            # CPU: a plain blocking copy (pinned memory and non-blocking copies need an accelerator).
            # CUDA + pinned: copy into cached pinned buffers on a side stream while training goes on.
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=pinned,
                    use_shared_memory=False,
                    use_async_staging=pinned,
                    use_non_blocking_copy=pinned,
                )
            )

    def _dcp_state(self, parts: list[str], dtype: str | None = None, model: ModelState | None = None) -> dict[str, Any]:
        """What DCP saves or loads: the model's tensors at the top level (in `dtype` if given; those of
        ``model``, default the run's own), every other part of `parts` as its Stateful under its name."""
        state: dict[str, Any] = {}
        if "model" in parts:
            state.update((model or self.model).state_dict())
            if dtype is not None:
                target = getattr(torch, dtype)
                state = {k: v.to(target) if v.dtype != target and v.is_floating_point() else v  # not integer state
                         for k, v in state.items()}
        state.update({part: self.states[part] for part in parts if part != "model"})
        return state

    # ------------------------------------------------------------------ saving

    def should_save(self, step: int, last: bool) -> bool:
        return self.ck.enable_checkpoint and (last or step % self.ck.interval == 0)

    def maybe_save(self, step: int, tokens_seen: int, *, last: bool) -> None:
        """Called after every optimizer step; saves at the interval and at the last step."""
        if not self.should_save(step, last):
            return
        formats = {"dcp", "hf"} if self.ck.save_format == "both" else {self.ck.save_format}
        if last and self.ck.last_save_in_hf:
            formats.add("hf")
        if "hf" in formats:  # first: an async DCP save started before it would have to finish first
            self.save_hf(step)
        if "dcp" in formats:
            weights_only = last and self.ck.last_save_model_weights_only
            self.save(step, tokens_seen, weights_only=weights_only,
                      dtype=self.ck.export_dtype if weights_only else None)

    def save_hf(self, step: int) -> Path:
        """``step-{N}-hf``: the current weights as a Hugging Face model folder, gathered tensor by
        tensor from the sharded model (``titanctl.checkpoint.run.hf_save``); every rank calls it at the
        same point, and it returns when the folder is complete (weights only, never resumed from)."""
        self.wait()  # the tensors travel on the checkpoint group: no async write may share it
        started = time.perf_counter()
        name = hf_folder_name(step)
        tmp, final = self.root / f"{TMP_PREFIX}{step}-hf", self.root / name
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if os.path.lexists(tmp):  # left by a run that died mid-save
                _discard(tmp)
            tmp.mkdir()
        failure = write_hf_folder(
            tmp, self.model, self.model_args, tokenizer=self._hf_tokenizer, dtype=getattr(torch, self.ck.export_dtype),
            rank=self.rank, world_size=self.world_size, group=self._pg, source_config=self.hf_config,
            layout=self.hf_files, carried=self.carried,
        )
        if self.rank == 0:
            try:
                if failure is None:
                    _fsync_dir(tmp)
                    if final.exists():  # the same step saved again (a resume from an earlier step)
                        _discard(final)
                    os.replace(tmp, final)
                    _fsync_dir(self.root)
                    self._retain()
            except Exception as e:
                failure = one_line(e)
            if failure is not None:
                _discard(tmp)
        if self._pg is not None:  # every rank stops with rank 0's line, or none does
            box = [failure]
            dist.broadcast_object_list(box, src=0, group=self._pg)
            failure = box[0]
        if failure is not None:
            raise CheckpointError(f"saving Hugging Face folder {final} failed: {failure}")
        self.log(f"Hugging Face save {name} written in {time.perf_counter() - started:.2f} s")
        return final

    def save_seed(self) -> Path:
        """checkpoint.create_seed_checkpoint: the initialized weights as step-0, written synchronously."""
        self.save(0, 0, weights_only=True, dtype=None, force_sync=True)
        return self.root / "step-0"

    def save(
        self, step: int, tokens_seen: int, *, weights_only: bool = False, dtype: str | None = None,
        force_sync: bool = False,
    ) -> None:
        self.wait()  # one save at a time: the previous one is durable before this one starts
        started = time.perf_counter()
        parts = ["model"] if weights_only else [p for p in STATE_PARTS if p in self.states]
        self.train_state.step, self.train_state.tokens_seen = step, tokens_seen
        state = self._dcp_state(parts, dtype)
        if self.lora is None:  # a LoRA run's steps hold its adapters: its base carries these
            state.update(self.carried.save_state())  # as they are: no export dtype
        tmp = self.root / f"{TMP_PREFIX}{step}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if os.path.lexists(tmp):  # left by a run that died mid-save (or planted as a link)
                _discard(tmp)
            tmp.mkdir()  # fresh: DCP's writer never follows a link someone left at this name
        self._barrier()  # nobody writes into tmp before rank 0 cleared it
        meta = {
            "step": step,
            "weights_only": weights_only,
            "dtype": dtype or _dtype_name(state),
            "contents": parts,
            "tokens_seen": tokens_seen,  # per data-parallel rank, as the trainer counts them
            "dp_degree": self.dp_degree,
            "global_batch_size": self.loader.global_batch_size,  # kept by a resume with global_batch_size -1
            "world_size": self.world_size,
            "torch_version": torch.__version__,
            # Exports (`titanctl convert --to hf/torchtune`) write this tokenizer's files beside the weights.
            "tokenizer_path": str(Path(self.cfg.model.tokenizer_path or DEFAULT_TOKENIZER_PATH).resolve()),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        if self.hf_config is not None:
            meta[HF_CONFIG_KEY] = self.hf_config
        if self.hf_files is not None:
            meta[HF_FILES_KEY] = self.hf_files
        if self.lora is not None:
            meta[LORA_KEY] = {**self.lora.record(), "base": self.lora_base}
        writer = ChecksumWriter(str(tmp), sync_files=True)
        timing = SaveTiming(step, 0.0)
        self.timings.append(timing)
        synchronous = self.async_mode == "disabled" or force_sync
        try:
            with quiet_dcp():
                if synchronous:
                    dcp.save(state, storage_writer=writer, process_group=self._pg, no_dist=self._pg is None)
                else:
                    result = dcp.async_save(
                        state, storage_writer=writer, process_group=self._pg, no_dist=self._pg is None,
                        async_stager=self._stager,
                    )
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            raise CheckpointError(f"saving checkpoint step {step} into {tmp} failed: {_reason(e)}") from None
        if synchronous:
            self._written(step, tmp, meta, writer)
            timing.blocking_s = timing.durable_s = time.perf_counter() - started
            self.log(f"checkpoint step-{step} saved in {timing.blocking_s:.2f} s")
            return
        staging, upload = None, result
        if not isinstance(result, Future):  # AsyncSaveResponse: staging itself runs in the background
            staging, upload = result.staging_completion, result.upload_completion
        pending = _Pending(step, tmp, meta, writer, started, upload, staging, timing)
        upload.add_done_callback(lambda fut: self._on_written(pending, fut))
        self._pending = pending
        timing.blocking_s = time.perf_counter() - started
        self.log(f"checkpoint step-{step} staged in {timing.blocking_s:.2f} s; writing in the background")

    def _written(self, step: int, tmp: Path, meta: dict[str, Any], writer: ChecksumWriter) -> None:
        """Every rank, once DCP wrote everything: rank 0 gathers the checksums and makes the folder visible."""
        checksums = gather_checksums(writer.checksums, self._pg)
        if self.rank == 0:
            self._finalize(step, tmp, meta, checksums)

    def _on_written(self, pending: _Pending, fut: Future) -> None:
        """Runs in DCP's writer thread when every rank has written (the checkpoint group is idle
        until ``wait`` returns, so its collectives can run here)."""
        try:
            if fut.exception() is None:
                self._written(pending.step, pending.tmp, pending.meta, pending.writer)
        except BaseException as e:
            pending.error = e
        finally:
            pending.timing.durable_s = time.perf_counter() - pending.started
            pending.done.set()

    def wait_for_staging(self) -> None:
        """Before the optimizer changes the weights: the staging copy must be complete (pinned mode)."""
        pending = self._pending
        if pending is not None and pending.staging is not None:
            pending.staging.result()
            pending.staging = None

    def wait(self) -> None:
        """Block until the outstanding async save is durable (a no-op when none is)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.upload.result()
        except (Exception, CheckpointException) as e:
            raise CheckpointError(
                f"saving checkpoint step {pending.step} into {pending.tmp} failed: {_reason(e)}"
            ) from None
        pending.done.wait()
        if pending.error is not None:
            raise CheckpointError(
                f"finishing checkpoint step {pending.step} in {self.root} failed: {_reason(pending.error)}"
            )
        self.log(f"checkpoint step-{pending.step} durable after {pending.timing.durable_s:.2f} s")

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.close()
        else:  # keep the original error; still wait, so no half-written save races the exit
            try:
                self.close()
            except BaseException as e:
                self.log(f"the outstanding checkpoint save failed too: {_reason(e)}")
        return False

    def _finalize(self, step: int, tmp: Path, meta: dict[str, Any], checksums: dict[str, str]) -> None:
        """Rank 0, after all ranks wrote: config, checksums and metadata, rename into place, retention."""
        (tmp / RUN_CONFIG).write_text(to_toml(self.cfg))
        checksums = {**checksums, **digest_files(tmp, [DCP_INDEX, RUN_CONFIG])}
        meta = dict(meta)
        write_metadata(tmp, self.model_args, step=meta.pop("step"), weights_only=meta.pop("weights_only"),
                       dtype=meta.pop("dtype"), checksums=record(checksums), **meta)
        _fsync_dir(tmp)
        final = self.root / f"step-{step}"
        if final.exists():  # the same step saved again (a resume from an earlier step)
            _discard(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        self._retain()

    def _retain(self) -> None:
        keep = self.ck.keep_latest_k
        steps = list(complete_checkpoints(self.root))
        if keep > 0:
            for step in steps[:-keep]:
                _discard(self.root / f"step-{step}")
            for folder in list(hf_saves(self.root).values())[:-keep]:  # counted apart from DCP steps
                _discard(folder)
        for child in self.root.iterdir():  # debris of runs that died mid-save or mid-delete
            if child.name.startswith(TMP_PREFIX) or child.name.startswith(TRASH_PREFIX):
                _discard(child)

    def _barrier(self) -> None:
        if self._pg is not None:
            dist.barrier(group=self._pg)

    # ------------------------------------------------------------------ loading

    def load(self, plan: LoadPlan | None = None) -> Resumed | None:
        """Restore ``plan`` (default: plan_load's choice); None when there is nothing to load.

        Nothing on disk changes. The data files are verified against their checksums first; a
        damaged step of the run's own folder gives way to the newest older one that verifies.
        """
        plan = plan or plan_load(self.cfg, self.model_args)
        if plan is None:
            return None
        for note in plan.notes:
            self.log(note)
        if isinstance(plan, LoRAPlan):
            return self._load_lora(plan)
        return self._load(plan)

    def _load_lora(self, plan: LoRAPlan) -> Resumed:
        """The base's weights (its fingerprint checked against the one the run's step records), then
        the run's own step when it resumes, or the adapters of the LoRA step it starts from."""
        record = base_record(plan.base.folder, plan.base_format, self._pg)
        adapters = plan.own or plan.start
        if plan.recorded is not None:
            check_same_base(plan.recorded, record, adapters.folder)
        self.lora_base = record
        resumed = self._load(plan.base)
        if adapters is None:
            return resumed
        base_config, base_files, base_carried = self.hf_config, self.hf_files, self.carried
        resumed = self._load(adapters)
        self.hf_config, self.hf_files = self.hf_config or base_config, self.hf_files or base_files
        self.carried.keep_unless_replaced(base_carried)
        return resumed

    def _load(self, plan: LoadPlan | ForeignPlan) -> Resumed:
        self.carried = CarriedTensors(self.rank)
        if isinstance(plan, ForeignPlan):
            carried = plan.source.extra_metadata()
            self.hf_config, self.hf_files = carried.get(HF_CONFIG_KEY), carried.get(HF_FILES_KEY)
            return self._read_foreign(plan)
        plan = self._verified(plan)
        self.hf_config, self.hf_files = plan.meta.get(HF_CONFIG_KEY), plan.meta.get(HF_FILES_KEY)
        resumed = self._read(plan)
        step = plan.step
        if plan.meta.get("weights_only") and not plan.initial and step > 0:
            # The run's own final export: the run is complete, nothing is left to train.
            resumed.step = step
            saved_dp = int(plan.meta.get("dp_degree", self.dp_degree))
            resumed.tokens_seen = int(plan.meta.get("tokens_seen", 0)) * saved_dp // self.dp_degree
        resumed.initial = plan.initial
        what = ", ".join(resumed.loaded) or "nothing"
        origin = "initial checkpoint" if plan.initial else "checkpoint"
        unverified = "" if plan.source.verified else " (no checksums recorded: not verified)"
        self.log(
            f"loaded {origin} {plan.folder} (step {step}){unverified}: {what}; "
            f"training continues at step {resumed.step}"
        )
        return resumed

    def _read_foreign(self, plan: ForeignPlan) -> Resumed:
        """Another tool's weights, each full tensor read once per rank and sliced locally."""
        with plan.source as source:
            load_source_into(self.weights.module, source, keep=self.weights.keep)
            self.carried.take_from(source)
        self.log(
            f"loaded initial checkpoint {plan.folder} ({plan.format}, converted on the fly, model from "
            f"{plan.source.origin or 'its files'}): model; training starts at step 0"
        )
        return Resumed(folder=plan.folder, step=0, tokens_seen=0, loaded=("model",), initial=True)

    def _verified(self, plan: LoadPlan) -> LoadPlan:
        """`plan` once its data files match their checksums (hashed in shares over the ranks)."""
        while True:
            try:
                plan.source.verify(group=self._pg)
                return plan
            except CheckpointCorrupt as damage:
                if not plan.may_fall_back:
                    raise
                older = plan_load(self.cfg, self.model_args, before_step=plan.step)
                if older is None:
                    raise CheckpointCorrupt(f"{damage} (and the run has no older checkpoint)") from None
                self.log(fallback_note(damage, older.folder))
                for note in older.notes:
                    self.log(note)
                plan = older

    def _read(self, plan: LoadPlan) -> Resumed:
        folder = plan.folder
        parts = [p for p in plan.parts if p in self.states]  # a part this run lacks (diloco) stays unread
        if "diloco" in parts and "diloco" not in plan.meta.get("contents", ()):
            raise CheckpointError(
                f"{folder} holds no DiLoCo state (global weights, outer optimizer): it was saved by a run "
                "without fault_tolerance.semi_sync_method = diloco; resume it with "
                "checkpoint.exclude_from_loading = diloco (the global weights then start from its weights)"
            )
        if "rng" in parts and not any(key.startswith(f"rng.rank{self.rank}.") for key in plan.source.entries):
            parts.remove("rng")  # RNG streams are per rank; ranks the saving run did not have keep theirs

        def missing(key: str) -> CheckpointError:
            part = key.split(".", 1)[0] if key.split(".", 1)[0] in STATE_PARTS else "model"
            return CheckpointError(
                f"{folder}: the checkpoint has no {part} entry {key!r} (saved by a different optimizer, "
                f"data setup or titanctl version?); skip it with checkpoint.exclude_from_loading = {part}"
            )

        # A LoRA step's model tensors are adapters and buffers, also when a new run starts from them.
        model = self.weights if plan.initial and LORA_KEY not in plan.meta else self.model
        state = self._dcp_state(parts, model=model)
        carried = self.carried.placeholders(plan.source.entries, str(folder)) if "model" in parts else {}
        state.update(carried)
        try:
            # A parameter no gradient had reached when the checkpoint was saved has no optimizer state there.
            unread = (self.states["optimizer"].stateless_in(plan.source.entries, "optimizer.")
                      if "optimizer" in parts else set())
            # A converted checkpoint stores a tied output layer once, as the embedding (a run's stores both keys).
            aliases = {alias: table for alias, table in tied_weights(self.model_args).items()
                       if alias in state and alias not in plan.source.entries and table in plan.source.entries}
            plan.source.load(state, process_group=self._pg, no_dist=self._pg is None, on_missing=missing,
                             unread=frozenset(unread | set(aliases)))
            for alias, table in aliases.items():
                state[alias] = state[table]
            self.carried.absorb(state, carried)
            if "model" in parts:
                model.load_state_dict({k: v for k, v in state.items() if k not in self.states})
        except TitanError as e:  # a Stateful's own check does not know the folder
            if str(e).startswith(str(folder)):
                raise
            raise CheckpointError(f"{folder}: {e}") from None
        step = self.train_state.step if "train_state" in parts else 0
        tokens = self.train_state.tokens_seen if "train_state" in parts else 0
        return Resumed(folder=folder, step=step, tokens_seen=tokens, loaded=tuple(parts), initial=False)


# ---------------------------------------------------------------------- helpers


def _dtype_name(state: dict[str, Any]) -> str:
    for value in state.values():
        if isinstance(value, torch.Tensor):
            return str(value.dtype).removeprefix("torch.")
    return "float32"


def _reason(e: BaseException) -> str:
    """One line: DCP's CheckpointException wraps per-rank failures in a multi-line message."""
    if isinstance(e, CheckpointException):
        e = first_failure(e)
    return one_line(e)


def _discard(path: Path) -> None:
    """Delete a folder so that no moment of the deletion leaves it looking like a checkpoint."""
    if not os.path.lexists(path):
        return
    if path.is_symlink():
        path.unlink()  # the link only, never what it points to
        return
    if not path.name.startswith(TRASH_PREFIX):
        trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
        os.replace(path, trash)
        path = trash
    shutil.rmtree(path, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

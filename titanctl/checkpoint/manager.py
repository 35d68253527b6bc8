"""Distributed checkpoints of a training run: save, resume, async writes, retention, atomicity.

Folder layout (``root = {job.dump_folder}/{checkpoint.folder}``)::

    root/step-{N}/            a complete checkpoint (plain DCP + titanctl.json + config.toml)
    root/.tmp-step-{N}/       a save in progress; never loaded, removed by the next save
    root/.trash-*/            a checkpoint being deleted (retention); never loaded

A save writes into ``.tmp-step-{N}``; when every rank has written its files (DCP's
coordinator writes ``.metadata`` only after that) rank 0 adds ``titanctl.json`` and
``config.toml`` and renames the folder to ``step-{N}``, then applies retention. A crash at
any moment therefore leaves earlier ``step-*`` folders intact, and a ``step-*`` folder is
complete by construction. Retention first renames a folder away, then deletes it, so a
half-deleted checkpoint never looks complete either.

The DCP state dict follows ``titanctl.checkpoint.metadata``: the model's canonical FQNs at
the top level, plus ``optimizer`` (flattened FQN keys, so it reshards across layouts),
``lr_scheduler``, ``dataloader``, ``train_state`` (step, tokens_seen) and ``rng``. Model and
optimizer go through ``torch.distributed.checkpoint.state_dict`` over all of this rank's
model parts (pipeline stages hold different parts), so names are canonical under every
layout and under compile/AC wrappers.

Async saves (``checkpoint.async_mode``) stage a CPU copy, then write in a background
thread on their own gloo process group (async DCP on the default group deadlocked). The
next training step does not wait for storage; the next save, and the end of training
(also on an exception), wait for the outstanding one.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import shutil
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from titanctl.checkpoint.metadata import METADATA_FILE, model_args_from_metadata, read_metadata, write_metadata
from titanctl.config.job_config import JobConfig
from titanctl.errors import CheckpointError, ConfigError, DataError
from titanctl.models.llama.args import ModelArgs

STEP_FOLDER = re.compile(r"step-(\d+)")
TMP_PREFIX = ".tmp-step-"
TRASH_PREFIX = ".trash-"
DCP_INDEX = ".metadata"
CONFIG_FILE = "config.toml"
# What a full checkpoint holds: the model's tensors at the top level, the other parts nested under their names.
STATE_PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
# Model-args fields that decide tensor shapes (named in mismatch messages).
_SHAPE_ARGS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "ffn_dim_multiplier")
# Optimizer param-group entries that choose a kernel for this layout, not training state.
_IMPL_KEYS = ("fused", "foreach", "capturable", "differentiable")


def complete_checkpoints(root: Path) -> dict[int, Path]:
    """{step: folder} of the complete checkpoints under ``root`` (temporary folders ignored)."""
    found = {}
    if root.is_dir():
        for child in root.iterdir():
            match = STEP_FOLDER.fullmatch(child.name)
            if match and child.is_dir():
                found[int(match.group(1))] = child
    return dict(sorted(found.items()))


@dataclasses.dataclass
class Resumed:
    """What a load restored."""

    folder: Path
    step: int
    tokens_seen: int
    loaded: tuple[str, ...]  # which of STATE_PARTS
    initial: bool  # from checkpoint.initial_load_path rather than the run's own folder


@dataclasses.dataclass
class LoadPlan:
    """A checked checkpoint to restore (plan_load): which folder, which parts."""

    folder: Path
    initial: bool  # from checkpoint.initial_load_path
    parts: list[str]  # of STATE_PARTS
    meta: dict[str, Any]  # titanctl.json
    index: Any  # the DCP Metadata

    @property
    def restores_model(self) -> bool:
        """The model's weights come from the checkpoint: initializing them first is wasted work."""
        return "model" in self.parts


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
    ) -> None:
        self.cfg = cfg
        self.ck = ck = cfg.checkpoint
        self.root = Path(cfg.job.dump_folder) / ck.folder
        self.model_parts = model_parts
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.loader = loader
        self.model_args = model_args
        self.rank, self.world_size, self.dp_degree = rank, world_size, dp_degree
        self.device = device
        self.log = log
        self.timings: list[SaveTiming] = []
        self._pending: _Pending | None = None

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
        self.async_mode = ck.async_mode if ck.enable_checkpoint else "disabled"
        self._model = _model_view(model_parts)
        self._pg = None
        if world_size > 1 and (self.saving or ck.initial_load_path):
            import torch.distributed as dist

            # Every collective of checkpointing runs here: async writes overlap training's own
            # collectives on the default group, which deadlocked when they shared it.
            self._pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=30))
        self._stager = None
        if self.async_mode != "disabled":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

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

    # ------------------------------------------------------------------ saving

    def should_save(self, step: int, last: bool) -> bool:
        return self.ck.enable_checkpoint and (last or step % self.ck.interval == 0)

    def maybe_save(self, step: int, tokens_seen: int, *, last: bool) -> None:
        """Called after every optimizer step; saves at the interval and at the last step."""
        if self.should_save(step, last):
            weights_only = last and self.ck.last_save_model_weights_only
            self.save(step, tokens_seen, weights_only=weights_only,
                      dtype=self.ck.export_dtype if weights_only else None)

    def save_seed(self) -> Path:
        """checkpoint.create_seed_checkpoint: the initialized weights as step-0, written synchronously."""
        self.save(0, 0, weights_only=True, dtype=None, force_sync=True)
        return self.root / "step-0"

    def save(
        self, step: int, tokens_seen: int, *, weights_only: bool = False, dtype: str | None = None,
        force_sync: bool = False,
    ) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        self.wait()  # one save at a time: the previous one is durable before this one starts
        started = time.perf_counter()
        state = self._state_to_save(step, tokens_seen, weights_only, dtype)
        tmp = self.root / f"{TMP_PREFIX}{step}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a run that died mid-save
                _discard(tmp)
        self._barrier()  # nobody writes into tmp before rank 0 cleared it
        meta = {
            "step": step,
            "weights_only": weights_only,
            "dtype": dtype or _dtype_name(state),
            "contents": ["model"] if weights_only else list(STATE_PARTS),
            "tokens_seen": tokens_seen,  # per data-parallel rank, as the trainer counts them
            "dp_degree": self.dp_degree,
            "world_size": self.world_size,
            "torch_version": torch.__version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        writer = FileSystemWriter(str(tmp), sync_files=True)
        timing = SaveTiming(step, 0.0)
        self.timings.append(timing)
        try:
            with _quiet_dcp():
                if self.async_mode == "disabled" or force_sync:
                    dcp.save(state, storage_writer=writer, process_group=self._pg, no_dist=self._pg is None)
                else:
                    result = dcp.async_save(
                        state, storage_writer=writer, process_group=self._pg, no_dist=self._pg is None,
                        async_stager=self._stager,
                    )
        except (Exception, _checkpoint_exception()) as e:  # DCP's CheckpointException is a BaseException
            raise CheckpointError(f"saving checkpoint step {step} into {tmp} failed: {_reason(e)}") from None
        if self.async_mode == "disabled" or force_sync:
            if self.rank == 0:
                self._finalize(step, tmp, meta)
            timing.blocking_s = timing.durable_s = time.perf_counter() - started
            self.log(f"checkpoint step-{step} saved in {timing.blocking_s:.2f} s")
            return
        staging, upload = None, result
        if not isinstance(result, Future):  # AsyncSaveResponse: staging itself runs in the background
            staging, upload = result.staging_completion, result.upload_completion
        pending = _Pending(step, tmp, meta, started, upload, staging, timing)
        upload.add_done_callback(lambda fut: self._on_written(pending, fut))
        self._pending = pending
        timing.blocking_s = time.perf_counter() - started
        self.log(f"checkpoint step-{step} staged in {timing.blocking_s:.2f} s; writing in the background")

    def _on_written(self, pending: _Pending, fut: Future) -> None:
        """Runs in DCP's writer thread when every rank has written: rank 0 makes the folder visible."""
        try:
            if fut.exception() is None and self.rank == 0:
                self._finalize(pending.step, pending.tmp, pending.meta)
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
        except (Exception, _checkpoint_exception()) as e:
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
                self.log(f"[red]the outstanding checkpoint save failed too: {_reason(e)}[/red]")
        return False

    def _finalize(self, step: int, tmp: Path, meta: dict[str, Any]) -> None:
        """Rank 0, after all ranks wrote: metadata, config, rename into place, retention."""
        from titanctl.config.loader import to_toml

        meta = dict(meta)
        write_metadata(tmp, self.model_args, step=meta.pop("step"), weights_only=meta.pop("weights_only"),
                       dtype=meta.pop("dtype"), **meta)
        (tmp / CONFIG_FILE).write_text(to_toml(self.cfg))
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
        for child in self.root.iterdir():  # debris of runs that died mid-save or mid-delete
            if child.name.startswith(TMP_PREFIX) or child.name.startswith(TRASH_PREFIX):
                _discard(child)

    def _barrier(self) -> None:
        if self._pg is not None:
            import torch.distributed as dist

            dist.barrier(group=self._pg)

    def _state_to_save(self, step: int, tokens_seen: int, weights_only: bool, dtype: str | None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state: dict[str, Any] = dict(get_model_state_dict(self._model))
        if dtype is not None:
            target = getattr(torch, dtype)
            state = {k: v.to(target) if v.dtype != target else v for k, v in state.items()}
        if weights_only:
            return state
        state["optimizer"] = self._optimizer_state()
        state["lr_scheduler"] = self.lr_scheduler.state_dict()
        state["dataloader"] = self._loader_state()
        state["train_state"] = {"step": step, "tokens_seen": tokens_seen, "dp_degree": self.dp_degree}
        state["rng"] = {f"rank{self.rank}": self._rng_state()}
        return state

    def _optimizer_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            self._model, self.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
        )

    def _loader_state(self) -> dict[str, Any]:
        if self.loader.n_windows is None:  # streaming: each data-parallel rank has its own position
            return {f"dp_rank{self.loader.dp_rank}": self.loader.state_dict()}
        return self.loader.state_dict()  # finite: the same on every rank, any layout

    def _rng_state(self) -> dict[str, torch.Tensor]:
        state = {"torch_cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["torch_cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    # ------------------------------------------------------------------ loading

    def load(self, plan: LoadPlan | None = None) -> Resumed | None:
        """Restore ``plan`` (default: plan_load's choice); None when there is nothing to load.

        Nothing on disk changes, and every check that needs no reading of tensors ran in plan_load.
        """
        plan = plan or plan_load(self.cfg, self.model_args)
        if plan is None:
            return None
        resumed = self._read(plan.folder, plan.index, plan.parts)
        step = int(plan.meta.get("step", 0))
        if plan.meta.get("weights_only") and not plan.initial and step > 0:
            # The run's own final export: the run is complete, nothing is left to train.
            resumed.step = step
            saved_dp = int(plan.meta.get("dp_degree", self.dp_degree))
            resumed.tokens_seen = int(plan.meta.get("tokens_seen", 0)) * saved_dp // self.dp_degree
        resumed.initial = plan.initial
        what = ", ".join(resumed.loaded) or "nothing"
        origin = "initial checkpoint" if plan.initial else "checkpoint"
        self.log(f"loaded {origin} {plan.folder} (step {step}): {what}; training continues at step {resumed.step}")
        return resumed

    def _read(self, folder: Path, index: Any, parts: list[str]) -> Resumed:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        entries = index.state_dict_metadata
        state: dict[str, Any] = {}
        model_keys: list[str] = []
        if "model" in parts:
            model_state = get_model_state_dict(self._model)
            model_keys = list(model_state)
            state.update(model_state)
        if "optimizer" in parts:
            # A fresh optimizer gets its state tensors (zero-lr step) to be read into.
            state["optimizer"] = self._optimizer_state()
        if "lr_scheduler" in parts:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        if "dataloader" in parts:
            state["dataloader"] = self._loader_state()
        if "train_state" in parts:
            state["train_state"] = {"step": 0, "tokens_seen": 0, "dp_degree": self.dp_degree}
        rng_key = f"rank{self.rank}"
        if "rng" in parts and any(k.startswith(f"rng.{rng_key}.") for k in entries):
            # RNG streams are per rank; ranks the saving run did not have keep their seeded state.
            state["rng"] = {rng_key: self._rng_state()}
        for key in _flat_keys(state):
            if key not in entries:
                part = key.split(".", 1)[0]
                raise CheckpointError(
                    f"{folder}: the checkpoint has no {part} entry {key!r} (saved by a different optimizer, "
                    f"data setup or titanctl version?); skip it with checkpoint.exclude_from_loading = {part}"
                )
        try:
            with _quiet_dcp():
                dcp.load(state, storage_reader=FileSystemReader(str(folder)), process_group=self._pg,
                         no_dist=self._pg is None)
        except (Exception, _checkpoint_exception()) as e:
            raise CheckpointError(f"{folder}: reading the checkpoint failed: {_reason(e)}") from None

        loaded = []
        if "model" in parts:
            set_model_state_dict(self._model, {k: state[k] for k in model_keys})
            loaded.append("model")
        if "optimizer" in parts:
            impl = [{k: g[k] for k in _IMPL_KEYS if k in g} for g in self.optimizer.param_groups]
            set_optimizer_state_dict(
                self._model, self.optimizer, state["optimizer"],
                options=StateDictOptions(flatten_optimizer_state_dict=True),
            )
            for group, kernel in zip(self.optimizer.param_groups, impl):
                group.update(kernel)  # the kernel that suits this layout, not the saving one's
            loaded.append("optimizer")
        if "lr_scheduler" in parts:
            sched = self.lr_scheduler
            sched.load_state_dict(state["lr_scheduler"])
            lambdas = getattr(sched, "lr_lambdas", None)
            if lambdas:
                # The schedule's shape comes from this run's config (training.steps may have grown):
                # recompute the current lr the way LambdaLR does instead of trusting the saved value.
                sched._last_lr = [base * f(sched.last_epoch) for f, base in zip(lambdas, sched.base_lrs)]
            for group, lr in zip(self.optimizer.param_groups, sched.get_last_lr()):
                group["lr"] = lr
            loaded.append("lr_scheduler")
        if "dataloader" in parts:
            data = state["dataloader"]
            try:
                if self.loader.n_windows is None:  # streaming: this data-parallel rank's position
                    data = data[f"dp_rank{self.loader.dp_rank}"]
                self.loader.load_state_dict(data)
            except DataError as e:
                raise CheckpointError(f"{folder}: {e}") from None
            loaded.append("dataloader")
        step, tokens = 0, 0
        if "train_state" in parts:
            train = state["train_state"]
            step = int(train["step"])
            saved_dp = int(train.get("dp_degree", self.dp_degree))
            tokens = int(train["tokens_seen"]) * saved_dp // self.dp_degree  # tokens per rank
            loaded.append("train_state")
        if "rng" in state:
            rng = state["rng"][rng_key]
            torch.set_rng_state(rng["torch_cpu"])
            if "torch_cuda" in rng and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng["torch_cuda"], self.device)
            loaded.append("rng")
        return Resumed(folder=folder, step=step, tokens_seen=tokens, loaded=tuple(loaded), initial=False)


# ---------------------------------------------------------------------- choosing and checking


def plan_load(cfg: JobConfig, model_args: ModelArgs) -> LoadPlan | None:
    """What a run with ``cfg`` restores at start, checked against the model: the newest complete
    checkpoint of the run (or checkpoint.load_step), else checkpoint.initial_load_path, else None.

    Reads only small files (no process group, no model needed), so it can run before the model is
    built: a bad checkpoint fails fast, and a run that restores its weights can skip initializing them.
    """
    ck = cfg.checkpoint
    check_config(cfg)
    picked = _pick(cfg)
    if picked is None:
        return None
    folder, initial = picked
    meta, index = check_folder(folder)
    parts = [p for p in STATE_PARTS if p not in ck.exclude_from_loading]
    if initial and ck.initial_load_model_weights_only:
        parts = [p for p in parts if p == "model"]
    step = int(meta.get("step", 0))
    if meta.get("weights_only"):
        parts = [p for p in parts if p == "model"]
        if not initial and 0 < step < cfg.training.steps:
            raise CheckpointError(
                f"{folder} is weights-only (the run's final export), so training cannot resume at step "
                f"{step}: set checkpoint.load_step to a full checkpoint, or start a new dump folder "
                f"with checkpoint.initial_load_path = {str(folder)!r}"
            )
    check_model(folder, meta, index, model_args)
    return LoadPlan(folder=folder, initial=initial, parts=parts, meta=meta, index=index)


def check_config(cfg: JobConfig) -> None:
    ck = cfg.checkpoint
    unknown = [name for name in ck.exclude_from_loading if name not in STATE_PARTS]
    if unknown:
        raise ConfigError(
            f"config key 'checkpoint.exclude_from_loading' has unknown {', '.join(map(repr, unknown))}; "
            f"valid: {', '.join(STATE_PARTS)}"
        )
    if ck.load_step < -1:
        raise ConfigError(f"config key 'checkpoint.load_step' = {ck.load_step} must be -1 (newest) or a step >= 0")


def _pick(cfg: JobConfig) -> tuple[Path, bool] | None:
    ck = cfg.checkpoint
    root = Path(cfg.job.dump_folder) / ck.folder
    own = complete_checkpoints(root) if ck.enable_checkpoint else {}
    if ck.enable_checkpoint and ck.load_step >= 0:
        if ck.load_step not in own:
            have = ", ".join(f"step-{s}" for s in own) or "none"
            raise CheckpointError(
                f"checkpoint.load_step = {ck.load_step}: {root / f'step-{ck.load_step}'} does not exist "
                f"(complete checkpoints there: {have})"
            )
        return own[ck.load_step], False
    if own:
        return own[max(own)], False
    if ck.initial_load_path:
        return resolve_checkpoint_path(Path(ck.initial_load_path), "checkpoint.initial_load_path"), True
    return None


def check_model(folder: Path, meta: dict[str, Any], index: Any, args: ModelArgs) -> None:
    """Every model tensor present with the model's shape, and nothing else, before any read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from titanctl.models.llama import Transformer

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}
    hint = _args_hint(meta, args)
    entries = index.state_dict_metadata
    for key, shape in expected.items():
        entry = entries.get(key)
        if entry is None:
            raise CheckpointError(f"{folder}: tensor {key} is missing from the checkpoint{hint}")
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{folder}: {key} is not a tensor in the checkpoint")
        if tuple(entry.size) != shape:
            raise CheckpointError(
                f"{folder}: tensor {key} has shape {_shape(entry.size)} in the checkpoint but {_shape(shape)} "
                f"in the model{hint}"
            )
    for key in entries:
        if key.split(".", 1)[0] not in STATE_PARTS and key not in expected:
            raise CheckpointError(f"{folder}: the checkpoint has tensor {key}, which the model does not{hint}")




def resolve_checkpoint_path(path: Path, what: str) -> Path:
    """A step folder, or a checkpoint root holding step-N folders (-> the newest complete one)."""
    if not path.exists():
        raise CheckpointError(f"{what} {path} does not exist")
    if path.is_file():
        raise CheckpointError(
            f"{what} {path} is a file, not a checkpoint folder (titanctl checkpoints are step-N folders "
            f"holding DCP files and {METADATA_FILE})"
        )
    if not (path / METADATA_FILE).exists():
        steps = complete_checkpoints(path)
        if steps:
            return steps[max(steps)]
    return path


def check_folder(folder: Path) -> tuple[dict[str, Any], Any]:
    """titanctl.json and the DCP index readable, every file the index names present and long enough.

    Returns (titanctl.json contents, DCP Metadata). Raises a one-line CheckpointError otherwise.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

    meta = read_metadata(folder)
    index_file = folder / DCP_INDEX
    if not index_file.is_file():
        raise CheckpointError(f"{index_file} is missing: {folder} is incomplete or not a DCP checkpoint")
    try:
        index = FileSystemReader(str(folder)).read_metadata()
    except Exception as e:
        raise CheckpointError(f"{index_file} is not a readable DCP index: {_reason(e)}") from None
    if not isinstance(index, Metadata) or not isinstance(index.storage_data, dict):
        raise CheckpointError(f"{index_file} is not a DCP index (it holds a {type(index).__name__})")
    needed: dict[str, int] = {}
    for info in index.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str):
            raise CheckpointError(f"{index_file} is not a file-system DCP index")
        needed[rel] = max(needed.get(rel, 0), info.offset + info.length)
    for rel, end in sorted(needed.items()):
        data = folder / rel
        if not data.is_file():
            raise CheckpointError(f"{data} is missing (the checkpoint's {DCP_INDEX} refers to it)")
        size = data.stat().st_size
        if size < end:
            raise CheckpointError(f"{data} is truncated: {size} bytes, but the checkpoint's {DCP_INDEX} needs {end}")
    return meta, index


# ---------------------------------------------------------------------- helpers


class _PartsView(nn.Module):
    """Several pipeline stages of one rank as one module with the canonical names.

    Stages are cut from one Transformer and keep its names (``layers`` is keyed by layer id),
    so their children merge without prefixes; the modules are shared, not copied.
    """

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        layers = nn.ModuleDict()
        for part in parts:
            if next(part.parameters(recurse=False), None) is not None:
                raise ValueError("a model part holds parameters of its own; cannot merge parts")
            for name, child in part.named_children():
                if name == "layers":
                    for layer_id, block in child.items():
                        layers[layer_id] = block
                elif name in self._modules:
                    raise ValueError(f"two model parts both hold {name!r}")
                else:
                    self.add_module(name, child)
        self.add_module("layers", layers)


def _model_view(parts: list[nn.Module]) -> nn.Module:
    return parts[0] if len(parts) == 1 else _PartsView(parts)


def _flat_keys(state: dict[str, Any], prefix: str = "") -> list[str]:
    """The keys DCP stores a nested state dict under ("a.b.c")."""
    keys = []
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            keys.extend(_flat_keys(value, f"{name}."))
        else:
            keys.append(name)
    return keys


def _args_hint(meta: dict[str, Any], args: ModelArgs) -> str:
    """' (n_layers 2 in the checkpoint's titanctl.json vs 4 in the recipe)', or '' when they agree."""
    try:
        saved = model_args_from_metadata(meta)
    except (KeyError, TypeError, ValueError):
        return ""
    diffs = [
        f"{name} {getattr(saved, name)} in the checkpoint's {METADATA_FILE} vs {getattr(args, name)} in the recipe"
        for name in _SHAPE_ARGS
        if getattr(saved, name) != getattr(args, name)
    ]
    return f" ({'; '.join(diffs)})" if diffs else ""


def _shape(size) -> str:
    return "(" + ", ".join(str(int(s)) for s in size) + ")"


def _dtype_name(state: dict[str, Any]) -> str:
    for value in state.values():
        if isinstance(value, torch.Tensor):
            return str(value.dtype).removeprefix("torch.")
    return "float32"


def _checkpoint_exception() -> type[BaseException]:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _reason(e: BaseException) -> str:
    """One line: DCP's CheckpointException wraps per-rank failures in a multi-line message."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    text = str(e).strip()
    line = text.splitlines()[0].rstrip(",:;") if text else ""
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


@contextmanager
def _quiet_dcp():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint.*")
        yield


def _discard(path: Path) -> None:
    """Delete a folder so that no moment of the deletion leaves it looking like a checkpoint."""
    if not path.exists():
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

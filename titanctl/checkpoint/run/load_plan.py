"""Which checkpoint a run restores at start, checked before the model exists.

``plan_load`` picks the newest complete ``step-N`` of the run (or ``checkpoint.load_step``),
else ``checkpoint.initial_load_path``, and checks it with everything that reads no tensor
data (``titanctl.checkpoint.trust.reader.DCPFolder``, then every model tensor's shape). When the
run's own newest step is damaged (``CheckpointCorrupt``: a checksum mismatch, a truncated
or missing file) and no step was asked for by number, it falls back to the newest older
step that passes, and says so. Anything else (a foreign or mismatched checkpoint, a refused
pickle, a folder it may not read) stops the run with one line: falling back there would
hide a problem the user has to fix. Hugging Face saves (``step-N-hf``) hold weights only and are
never resumed from: a folder holding them but no DCP step stops the run, newer ones are noted.

``checkpoint.initial_load_path`` may also name another tool's checkpoint (Hugging Face,
torchtitan, Meta, torchtune): it becomes a ``ForeignPlan``, its format ``Source`` bound to
this run's model (every shape checked before anything is built) and streamed into the model
tensor by tensor at load, converted on the fly, with no converted copy on disk. Block-quantized FP8
weights (DeepSeek-V3's release) are dequantized in float32 (the source's default ``dequantize_to``)
and rounded once to the model's own dtype as each is copied in; their scales are checked when planned.

A LoRA run (``lora.enable``) starts from two checkpoints: its base (``checkpoint.initial_load_path``, or
the base its own newest step records) and, when it resumes, its own step, which holds the adapters,
optimizer and step only: ``plan_load`` returns a ``LoRAPlan`` of both (``titanctl.checkpoint.lora.base``).
A LoRA step as ``checkpoint.initial_load_path`` (another run's, or a peft adapter brought in by ``convert
--from peft``) starts a LoRA run of the same adapters: the base it records, then its adapters and saved
buffers, and nothing else of it (a new optimizer, step 0).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titanctl.checkpoint.formats import detect, open_source
from titanctl.checkpoint.formats.dcp import is_carried
from titanctl.checkpoint.locate import STEP_FOLDER as STEP_FOLDER  # re-exported (manager)
from titanctl.checkpoint.locate import complete_checkpoints, locate
from titanctl.checkpoint.lora.base import LoRAPlan, base_folder, check_lora_run, no_base, read_record
from titanctl.checkpoint.run.hf_save import newer_hf_saves_note, only_hf_saves_error
from titanctl.checkpoint.trust.metadata import METADATA_FILE, model_args_from_metadata
from titanctl.checkpoint.trust.reader import DCPFolder
from titanctl.config.job_config import JobConfig
from titanctl.errors import CheckpointCorrupt, CheckpointError, ConfigError
from titanctl.models.common.args import ModelArgs
from titanctl.models.shapes import tied_weights, weight_shapes
from titanctl.parallel.converters.lora import saved_shapes

# What a full checkpoint holds: the model's tensors at the top level, the other parts nested under their names.
# ``diloco`` (DiLoCo's global weights and outer optimizer, titanctl.parallel.runtime.diloco_state) only in the
# checkpoints of a DiLoCo run, and loaded only by one; ``reference`` (an RL run's frozen reference model,
# titanctl.rl.loop) only in those of an RL run with a KL penalty.
STATE_PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng", "diloco", "reference")
# Model-args fields that decide tensor shapes (named in mismatch messages).
_SHAPE_ARGS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "ffn_dim_multiplier")


@dataclasses.dataclass
class LoadPlan:
    """A checked checkpoint to restore: which folder, which parts."""

    folder: Path
    initial: bool  # from checkpoint.initial_load_path
    parts: list[str]  # of STATE_PARTS
    meta: dict[str, Any]  # titanctl.json
    source: DCPFolder  # the folder opened for reading (index read, files checked; data not yet verified)
    may_fall_back: bool = False  # the run's own newest step: an older one may replace it if damaged
    notes: list[str] = dataclasses.field(default_factory=list)  # what the choice skipped, and why

    @property
    def index(self) -> Any:
        """The DCP Metadata."""
        return self.source.index

    @property
    def step(self) -> int:
        return int(self.meta.get("step", 0))

    @property
    def restores_model(self) -> bool:
        """The model's weights come from the checkpoint: initializing them first is wasted work."""
        return "model" in self.parts


@dataclasses.dataclass
class ForeignPlan:
    """Model weights from another tool's checkpoint, as this run's starting point (never a resume)."""

    folder: Path
    format: str  # of titanctl.checkpoint.formats.FORMATS
    source: Any  # a bound titanctl.checkpoint.formats.Source
    initial: bool = True
    parts: tuple[str, ...] = ("model",)
    step: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)
    restores_model: bool = True


def plan_load(
    cfg: JobConfig, model_args: ModelArgs, *, before_step: int | None = None
) -> LoadPlan | ForeignPlan | LoRAPlan | None:
    """What a run with ``cfg`` restores at start, checked against the model; None: nothing to restore.

    ``before_step``: only the run's own steps older than it (a fallback after a damaged step; a LoRA
    run's own step then comes alone, not as a LoRAPlan).
    Reads only small files (no process group, no model needed), so it can run before the model is
    built: a bad checkpoint fails fast, and a run that restores its weights can skip initializing them.
    """
    check_config(cfg)
    if cfg.lora.enable:
        check_lora_run(cfg)
    plan = _plan_own_or_initial(cfg, model_args, before_step)
    if cfg.lora.enable and before_step is None:
        if plan is None:  # neither a step of its own (which records its base) nor a base to start from
            raise no_base()
        return _lora_plan(plan, cfg, model_args)
    return plan


def _lora_plan(plan: LoadPlan | ForeignPlan, cfg: JobConfig, model_args: ModelArgs) -> LoRAPlan:
    """The base to load (and the run's own step, or the LoRA step it starts from, when ``plan`` is one):
    see the module docstring."""
    record = read_record(plan.meta, plan.folder) if isinstance(plan, LoadPlan) else None
    if plan.initial and record is None:
        return LoRAPlan(base=plan, notes=plan.notes)
    given = None if plan.initial else cfg.checkpoint.initial_load_path  # a start names the step, not the base
    moved = " (moved? merge the adapters with `titanctl convert STEP OUT --merge-lora --lora-base WHERE`)" \
        if plan.initial else None
    folder = resolve_checkpoint_path(base_folder(record, given, plan.folder, moved), "the LoRA base")
    base = _foreign_plan(folder, cfg, model_args) if not (folder / METADATA_FILE).exists() else \
        _plan(folder, True, cfg, model_args)
    own, start = (None, plan) if plan.initial else (plan, None)
    return LoRAPlan(base=base, own=own, start=start, recorded=record["base"], notes=[*plan.notes, *base.notes])


def _plan_own_or_initial(
    cfg: JobConfig, model_args: ModelArgs, before_step: int | None
) -> LoadPlan | ForeignPlan | None:
    candidates, initial, may_fall_back = _candidates(cfg, before_step)
    damaged: list[CheckpointCorrupt] = []
    for folder in candidates:
        if initial and not (folder / METADATA_FILE).exists():
            return _foreign_plan(folder, cfg, model_args)
        try:
            plan = _plan(folder, initial, cfg, model_args)
        except CheckpointCorrupt as e:
            if not may_fall_back:
                raise
            damaged.append(e)
            continue
        plan.may_fall_back = may_fall_back
        plan.notes = [fallback_note(e, folder) for e in damaged]
        newer_hf = None if initial else newer_hf_saves_note(folder.parent, plan.step)
        plan.notes += [newer_hf] if newer_hf else []
        return plan
    if damaged:
        more = f" (older checkpoints are damaged too: {len(damaged) - 1} more)" if len(damaged) > 1 else ""
        raise CheckpointCorrupt(f"{damaged[0]}{more}")
    return None


def fallback_note(damage: CheckpointCorrupt, folder: Path) -> str:
    return f"note: {damage}; falling back to {folder}"


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


def _candidates(cfg: JobConfig, before_step: int | None) -> tuple[list[Path], bool, bool]:
    """(folders to try, newest first; from initial_load_path; may fall back to the next one)."""
    ck = cfg.checkpoint
    root = Path(cfg.job.dump_folder) / ck.folder
    own = complete_checkpoints(root) if ck.enable_checkpoint else {}
    newest_first = [own[s] for s in sorted(own, reverse=True)]
    if before_step is not None:
        return [own[s] for s in sorted(own, reverse=True) if s < before_step], False, True
    if ck.enable_checkpoint and ck.load_step >= 0:
        if ck.load_step not in own:
            have = ", ".join(f"step-{s}" for s in own) or "none"
            raise CheckpointError(
                f"checkpoint.load_step = {ck.load_step}: {root / f'step-{ck.load_step}'} does not exist "
                f"(complete checkpoints there: {have})"
            )
        return [own[ck.load_step]], False, False  # asked for by number: never another one
    if newest_first:
        return newest_first, False, True
    if ck.initial_load_path:
        return [resolve_checkpoint_path(Path(ck.initial_load_path), "checkpoint.initial_load_path")], True, False
    only_hf = only_hf_saves_error(root) if ck.enable_checkpoint else None
    if only_hf is not None:  # starting afresh would silently overwrite them
        raise only_hf
    return [], False, False


def _plan(folder: Path, initial: bool, cfg: JobConfig, model_args: ModelArgs) -> LoadPlan:
    ck = cfg.checkpoint
    source = DCPFolder(folder)
    meta = source.meta
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
    record = read_record(meta, folder)
    if record is not None or (cfg.lora.enable and not initial):
        _check_lora_checkpoint(folder, record, initial, cfg, model_args)
    expected = saved_shapes(model_args, cfg.lora) if record is not None else None
    check_model(folder, meta, source.entries, model_args, expected)
    return LoadPlan(folder=folder, initial=initial, parts=parts, meta=meta, source=source)


def _check_lora_checkpoint(folder: Path, record: dict | None, initial: bool, cfg: JobConfig,
                           model_args: ModelArgs) -> None:
    """A LoRA step (adapters only) starts or resumes only a LoRA run of the same adapters, and a LoRA run
    resumes only what it trains."""
    if record is not None and initial and not cfg.lora.enable:
        raise CheckpointError(
            f"checkpoint.initial_load_path {folder} holds LoRA adapters only (trained on {record['base']['path']}): "
            f"start from a whole model, e.g. `titanctl convert {folder} OUT --to dcp --merge-lora`, or train the "
            "adapters on with lora.enable"
        )
    if record is None:
        raise CheckpointError(
            f"{folder} holds a whole model, saved without lora, which a LoRA run (lora.enable) does not resume: "
            f"start a new job.dump_folder with checkpoint.initial_load_path = {str(folder)!r}"
        )
    if not cfg.lora.enable:
        raise CheckpointError(
            f"{folder} holds LoRA adapters (rank {record['rank']}, alpha {record['alpha']:g}): resume it with "
            "lora.enable = true and its lora settings, or start a new job.dump_folder"
        )
    if record["alpha"] != cfg.lora.alpha:
        raise CheckpointError(
            f"{folder}'s adapters were trained with lora.alpha = {record['alpha']:g}, this run has "
            f"{cfg.lora.alpha:g}: the same adapters would scale differently; keep lora.alpha"
        )
    if initial:
        _check_same_adapters(folder, record, cfg, model_args)


def _check_same_adapters(folder: Path, record: dict, cfg: JobConfig, model_args: ModelArgs) -> None:
    """A LoRA step a run starts from holds the adapters its lora settings make, of the same rank."""
    from titanctl.checkpoint.lora.peft_import import target_modules
    from titanctl.parallel.converters.lora import adapter_names, is_adapter

    theirs = {n for target, kind in record["targets"].items() for n in adapter_names(target, kind)}
    ours = {n for n in saved_shapes(model_args, cfg.lora) if is_adapter(n)}
    if record["rank"] != cfg.lora.rank or theirs != ours:
        modules = ",".join(target_modules(record["targets"], model_args.n_layers))
        raise CheckpointError(
            f"checkpoint.initial_load_path {folder} holds adapters of rank {record['rank']} on "
            f"{len(record['targets'])} modules, this run's lora settings make rank {cfg.lora.rank} on "
            f"{len(ours) // 2}: train them on with lora.rank = {record['rank']} and lora.target_modules = {modules} "
            "(lora.target_regex unset)"
        )


def _foreign_plan(folder: Path, cfg: JobConfig, model_args: ModelArgs) -> ForeignPlan:
    """Another tool's checkpoint as initial weights: its format told by its files, every tensor's
    shape and the model's non-shape settings (RoPE, norm eps) checked against this run's model."""
    fmt = detect(folder)
    if not cfg.checkpoint.initial_load_model_weights_only:
        raise ConfigError(
            f"checkpoint.initial_load_path {folder} is a {fmt} checkpoint, which holds model weights only: "
            "set checkpoint.initial_load_model_weights_only = true"
        )
    source = open_source(folder, fmt)
    try:
        own, origin = source.own_args()
        if own is not None:
            _check_same_model(own, model_args, f"{folder}'s {origin}")
        source.bind(model_args, "this run's recipe")
    except BaseException:
        source.close()
        raise
    notes = [f"note: {folder}: {note}" for note in source.notes]
    return ForeignPlan(folder=folder, format=fmt, source=source, notes=notes)


def _check_same_model(saved: ModelArgs, args: ModelArgs, where: str) -> None:
    """Settings that change the model's function without changing a shape must agree too."""
    for name in ("rope_theta", "rope_scaling", "norm_eps"):
        if getattr(saved, name) != getattr(args, name):
            raise CheckpointError(
                f"{where} has {name} = {getattr(saved, name)}, but this run's model has {getattr(args, name)}: "
                "choose the recipe (model.flavor) that matches the checkpoint"
            )


def check_model(
    folder: Path, meta: dict[str, Any], entries: dict[str, Any], args: ModelArgs,
    expected: dict[str, tuple[int, ...]] | None = None,
) -> None:
    """Every model tensor present with the model's shape, and nothing else, before any read.
    ``expected``: the tensors the checkpoint holds when not the whole model's (a LoRA step's)."""
    expected = weight_shapes(args) if expected is None else expected
    hint = _args_hint(meta, args)
    aliases = tied_weights(args)
    for key, shape in expected.items():
        entry = entries.get(key)
        if entry is None and aliases.get(key) in entries:  # a tied output layer stored once, as the embedding
            continue
        if entry is None:
            raise CheckpointError(f"{folder}: tensor {key} is missing from the checkpoint{hint}")
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{folder}: {key} is not a tensor in the checkpoint")
        if tuple(entry.size) != shape:
            raise CheckpointError(
                f"{folder}: tensor {key} has shape {_shape(entry.size)} in the checkpoint but {_shape(shape)} "
                f"in the model{hint}"
            )
    for key in entries:  # a Hugging Face folder's carried tensors (``hf.hub_layout``) are no part of the model
        if key.split(".", 1)[0] not in STATE_PARTS and key not in expected and not is_carried(key):
            raise CheckpointError(f"{folder}: the checkpoint has tensor {key}, which the model does not{hint}")


def resolve_checkpoint_path(path: Path, what: str) -> Path:
    """A checkpoint folder, or a folder of step-N folders (-> the newest complete one): see
    ``titanctl.checkpoint.locate``, which also refuses a path that holds no checkpoint."""
    return locate(path, what).folder


def _args_hint(meta: dict[str, Any], args: ModelArgs) -> str:
    """' (n_layers 2 in the checkpoint's titanctl.json vs 4 in the recipe)', or '' when they agree."""
    try:
        saved = model_args_from_metadata(meta)
    except CheckpointError:
        return ""
    diffs = [
        f"{name} {getattr(saved, name)} in the checkpoint's {METADATA_FILE} vs {getattr(args, name)} in the recipe"
        for name in _SHAPE_ARGS
        if getattr(saved, name) != getattr(args, name)
    ]
    return f" ({'; '.join(diffs)})" if diffs else ""


def _shape(size) -> str:
    return "(" + ", ".join(str(int(s)) for s in size) + ")"

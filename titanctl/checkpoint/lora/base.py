"""The frozen base of a LoRA run: where it comes from, and the check that it is still that base.

A LoRA run's checkpoints hold its adapters, optimizer and step, not the base (megabytes, not
gigabytes). So each step's ``titanctl.json`` records, under ``lora``, the adapters (rank, alpha,
dropout, targets) and their base: ``{"path", "format", "fingerprint"}``, the base being the folder
``checkpoint.initial_load_path`` named when the run started (any checkpoint it reads: a titanctl
step, a Hugging Face, torchtitan, Meta or torchtune folder), resolved to an absolute path.

The fingerprint is SHA-256 over the base's weights: for a titanctl step folder that records
checksums, over that manifest (the load then verifies every file against it); for any other folder,
over the content of its weight files and the files that describe them (``*.safetensors``, ``*.bin``,
``*.pt``, ``*.pth``, ``*.distcp``, ``config.json``, ``params.json``, ``.metadata``, the safetensors
index), hashed in shares over the ranks. A resume, and ``convert --merge-lora``, recompute it and
refuse in one line when the base is missing or its weights changed. The base may move: the recipe's
``checkpoint.initial_load_path`` (or ``convert --lora-base``) then names where it is now, and the
fingerprint says whether it is the same base.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from titanctl.checkpoint.trust import checksums
from titanctl.checkpoint.trust.metadata import METADATA_FILE, read_metadata
from titanctl.config.job_config import JobConfig
from titanctl.errors import CheckpointError, ConfigError

LORA_KEY = "lora"  # titanctl.json's entry of a LoRA checkpoint
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp")
_DESCRIBING = ("config.json", "params.json", ".metadata", "model.safetensors.index.json")


def no_base() -> ConfigError:
    """A LoRA run with no base: neither a step of its own (which records one) nor initial_load_path."""
    return ConfigError(
        "lora.enable needs checkpoint.initial_load_path: the base model the adapters train on (a titanctl "
        "step folder, or a Hugging Face, torchtitan, Meta or torchtune folder)"
    )


def check_lora_run(cfg: JobConfig) -> None:
    """What a LoRA run's checkpointing cannot do, refused before anything is built."""
    ck = cfg.checkpoint
    if not ck.initial_load_model_weights_only:
        raise ConfigError(
            "lora.enable takes only the base's weights from checkpoint.initial_load_path: set "
            "checkpoint.initial_load_model_weights_only = true"
        )
    if ck.create_seed_checkpoint:
        raise ConfigError("checkpoint.create_seed_checkpoint with lora.enable: a LoRA run's base is its seed")
    if ck.enable_checkpoint and (ck.save_format != "dcp" or ck.last_save_in_hf):
        key = "last_save_in_hf = true" if ck.last_save_in_hf else f"save_format = {ck.save_format!r}"
        raise ConfigError(
            f"checkpoint.{key} with lora.enable: a LoRA run saves its adapters only; export a step with "
            "`titanctl convert STEP OUT --to hf --merge-lora` (a merged model) or `--to peft` (the adapters)"
        )


def _hashed_files(folder: Path) -> list[str]:
    try:
        names = sorted(p.name for p in Path(folder).iterdir()
                       if p.is_file() and (p.suffix in _WEIGHT_SUFFIXES or p.name in _DESCRIBING))
    except OSError as e:
        raise CheckpointError(f"cannot read the LoRA base {folder}: {e.strerror or e}") from None
    if not names:
        raise CheckpointError(f"the LoRA base {folder} holds no weight files")
    return names


def fingerprint(folder: Path, group=None) -> str:
    """The base's fingerprint (see the module docstring); with ``group``, every rank hashes a share."""
    folder = Path(folder)
    if (folder / METADATA_FILE).is_file():
        manifest = checksums.recorded(read_metadata(folder), folder / METADATA_FILE)
        if manifest is not None:
            text = json.dumps(checksums.record(manifest), sort_keys=True)
            return f"sha256:manifest:{hashlib.sha256(text.encode()).hexdigest()}"
    names = _hashed_files(folder)
    rank, world = 0, 1
    if group is not None:
        import torch.distributed as dist

        rank, world = dist.get_rank(group), dist.get_world_size(group)
    try:
        mine = checksums.digest_files(folder, names[rank::world])
    except OSError as e:
        raise CheckpointError(f"cannot read the LoRA base {folder} to fingerprint it: {e.strerror or e}") from None
    everyone = checksums.gather_checksums(mine, group)
    text = json.dumps(dict(sorted(everyone.items())), sort_keys=True)
    return f"sha256:files:{hashlib.sha256(text.encode()).hexdigest()}"


def base_record(folder: Path, fmt: str, group=None) -> dict[str, str]:
    """``{"path", "format", "fingerprint"}`` of the base at ``folder``."""
    return {"path": str(Path(folder).resolve()), "format": fmt, "fingerprint": fingerprint(folder, group)}


def check_same_base(recorded: dict[str, str], now: dict[str, str], where: Path) -> None:
    """The adapters of ``where`` were trained on ``recorded``'s base: ``now`` must be it."""
    if recorded["fingerprint"] != now["fingerprint"]:
        moved = "" if recorded["path"] == now["path"] else f" (recorded at {recorded['path']})"
        raise CheckpointError(
            f"the LoRA base {now['path']}{moved} is not the one the adapters of {where} were trained on: its "
            f"weights' fingerprint is {now['fingerprint']}, {where}/{METADATA_FILE} records {recorded['fingerprint']}; "
            "restore that base, or start a new job.dump_folder to train adapters on this one"
        )


def read_record(meta: dict[str, Any] | None, where: Path) -> dict[str, Any] | None:
    """The ``lora`` entry of a titanctl.json, checked field by field; None for a checkpoint without adapters."""
    entry = (meta or {}).get(LORA_KEY)
    if entry is None:
        return None

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{Path(where) / METADATA_FILE}: 'lora' {what}")

    rank, alpha = entry.get("rank"), entry.get("alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise bad(f"has rank {rank!r}, expected a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise bad(f"has alpha {alpha!r}, expected a positive number")
    dropout = entry.get("dropout", 0.0)
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout < 1:
        raise bad(f"has dropout {dropout!r}, expected a number in [0, 1)")
    targets = entry.get("targets")
    if not isinstance(targets, dict) or not targets or not all(
            isinstance(k, str) and v in ("linear", "experts") for k, v in targets.items()):
        raise bad("has no targets {module: 'linear' | 'experts'}")
    base = entry.get("base")
    if not isinstance(base, dict) or not all(isinstance(base.get(k), str) for k in ("path", "format", "fingerprint")):
        raise bad("records no base {path, format, fingerprint}")
    return entry


def base_folder(record: dict[str, Any], given: str | os.PathLike | None, where: Path,
                moved: str | None = None) -> Path:
    """Where the base is: ``given`` (the recipe's initial_load_path, or convert --lora-base), else the
    recorded path; a one-line CheckpointError when it is gone (``moved``: what to do then, when the
    recorded path was used)."""
    folder = Path(given) if given else Path(record["base"]["path"])
    if not folder.exists():
        said = "given" if given else f"recorded in {Path(where) / METADATA_FILE}"
        hint = "" if given else moved or " (moved? name it with checkpoint.initial_load_path, or convert --lora-base)"
        raise CheckpointError(
            f"the LoRA base {folder} ({said}), which the adapters of {where} were trained on, is missing{hint}"
        )
    return folder


@dataclasses.dataclass
class LoRAPlan:
    """A LoRA run's start: its base's weights (``base``, an initial plan), then, when the run resumes,
    its own step (``own``: adapters, optimizer, step...) trained on that base (``recorded``), or when it
    starts from a LoRA step, that step's adapters and buffers (``start``)."""

    base: Any  # titanctl.checkpoint.run.load_plan.LoadPlan | ForeignPlan, initial, model only
    own: Any = None  # titanctl.checkpoint.run.load_plan.LoadPlan of the run's own step
    start: Any = None  # or of the LoRA step a new run starts from (initial_load_path): its adapters only
    recorded: dict[str, str] | None = None  # the own (or start) step's base record
    notes: list[str] = dataclasses.field(default_factory=list)
    restores_model: bool = True  # the base's weights, and the adapters when resuming

    @property
    def initial(self) -> bool:
        return self.own is None

    @property
    def step(self) -> int:
        return 0 if self.own is None else self.own.step

    @property
    def meta(self) -> dict[str, Any]:
        return {} if self.own is None else self.own.meta

    @property
    def base_format(self) -> str:
        return getattr(self.base, "format", "dcp")

"""What a checkpoint path holds: the one place that decides, for every command that reads one.

A user names a checkpoint by a path (``convert SRC``, ``infer-tp --checkpoint``,
``checkpoint.initial_load_path``); :func:`locate` resolves it to one folder and its format:

- a folder holding a DCP checkpoint (``titanctl.json`` and/or ``.metadata``): that folder;
- a folder of ``step-N`` folders (a run's ``checkpoint`` folder, titanctl's or torchtitan's):
  its newest complete step, a ``step-N`` folder that holds ``titanctl.json`` or ``.metadata``
  (titanctl renames a step folder into place only when it is complete; torchtitan writes
  ``.metadata`` last, so a step folder holding neither is an unfinished save or a stray folder);
- any other folder: itself, another tool's checkpoint (Meta, Hugging Face, torchtune).

Its format is told by its files (``titanctl.checkpoint.formats.detect``), or given. A run's own
checkpoint folder is read by :func:`complete_checkpoints` (every ``step-N`` folder, whole or
damaged: resume falls back from a damaged one and says so).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from titanctl.checkpoint.formats import FORMATS, detect
from titanctl.checkpoint.formats.base import torch_weight_files
from titanctl.checkpoint.formats.hf import CONFIG_FILE as HF_CONFIG
from titanctl.checkpoint.formats.meta import PARAMS_FILE
from titanctl.checkpoint.trust.metadata import METADATA_FILE
from titanctl.checkpoint.trust.reader import DCP_INDEX
from titanctl.errors import CheckpointError

STEP_FOLDER = re.compile(r"step-(\d+)")
PEFT_ADAPTER_CONFIG = "adapter_config.json"  # a peft adapter, which holds no model (checkpoint.lora.export)
# A folder holding either is a DCP checkpoint (titanctl's: both; torchtitan's: the index alone).
DCP_FILES = (METADATA_FILE, DCP_INDEX)
_EXPECTED = (
    f"a DCP step folder ({METADATA_FILE} + {DCP_INDEX}), a folder of step-N folders, a torchtitan DCP folder "
    f"({DCP_INDEX} alone), a Hugging Face folder ({HF_CONFIG} + *.safetensors), a Meta folder "
    f"({PARAMS_FILE} + consolidated.*.pth) or a torchtune folder (*.bin/*.pt)"
)


@dataclass(frozen=True)
class Located:
    """A checkpoint folder and what it holds."""

    folder: Path  # the folder that holds the weights (a step-N folder when given its parent)
    format: str  # of titanctl.checkpoint.formats.FORMATS
    step: int | None  # N of a step-N folder; None for any other folder


def complete_checkpoints(root: Path) -> dict[int, Path]:
    """{step: folder} of a run's own ``step-N`` folders under ``root`` (temporary folders ignored)."""
    found = {}
    try:
        if root.is_dir():
            for child in root.iterdir():
                match = STEP_FOLDER.fullmatch(child.name)
                if match and child.is_dir():
                    found[int(match.group(1))] = child
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint folder {root}: {e.strerror or e}") from None
    return dict(sorted(found.items()))


def step_of(folder: Path) -> int | None:
    match = STEP_FOLDER.fullmatch(Path(folder).name)
    return int(match.group(1)) if match else None


def locate(path: str | Path, what: str = "checkpoint", fmt: str | None = None) -> Located:
    """The checkpoint folder ``path`` names and its format (``fmt`` when given, else detected).

    ``what`` names the path in messages (``checkpoint``, ``checkpoint.initial_load_path``).
    Raises a one-line CheckpointError for a missing path, a file, an unreadable folder, or a
    folder whose files are no checkpoint format.
    """
    if fmt is not None and fmt not in FORMATS:
        raise CheckpointError(f"unknown checkpoint format {fmt!r}; valid: {', '.join(FORMATS)}")
    path = Path(path)
    try:
        if not path.exists():
            raise CheckpointError(f"{what} {path} does not exist")
        if not path.is_dir():
            raise CheckpointError(
                f"{what} {path} is a file, not a checkpoint folder (give the folder that holds it: "
                f"{_EXPECTED})"
            )
        names = {p.name for p in path.iterdir()}
        if PEFT_ADAPTER_CONFIG in names:
            raise CheckpointError(
                f"{what} {path} is a peft adapter ({PEFT_ADAPTER_CONFIG}), not a model: bring it onto its base first, "
                f"`titanctl convert {path} OUT --from peft --lora-base BASE` (a titanctl LoRA checkpoint)"
            )
        folder = path
        if not names & set(DCP_FILES):
            folder = _newest_step(path, names) or path
            if folder is not path:
                names = {p.name for p in folder.iterdir()}
    except PermissionError:
        raise CheckpointError(f"cannot read {what} folder {path}: permission denied") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {what} folder {path}: {e.strerror or e}") from None
    if fmt is None:
        _check_looks_like_one(folder, names, what)
        fmt = detect(folder)
    return Located(folder, fmt, step_of(folder))


def _newest_step(root: Path, names: set[str]) -> Path | None:
    """The newest complete step-N folder of ``root`` (see the module docstring), or None."""
    steps = [
        (int(m.group(1)), root / name)
        for name in names
        if (m := STEP_FOLDER.fullmatch(name)) and any((root / name / f).is_file() for f in DCP_FILES)
    ]
    return max(steps)[1] if steps else None


def _check_looks_like_one(folder: Path, names: set[str], what: str) -> None:
    """Before ``detect``: a folder holding no file of any checkpoint format (or a config.json
    without weights) gets a message that says what was expected."""
    if names & {*DCP_FILES, PARAMS_FILE} or any(n.endswith(".safetensors") for n in names):
        return
    try:
        weights = torch_weight_files(folder)
    except OSError as e:
        raise CheckpointError(f"cannot read {what} folder {folder}: {e.strerror or e}") from None
    if weights:
        return
    if HF_CONFIG in names:
        raise CheckpointError(f"{folder} has a {HF_CONFIG} but no *.safetensors files (no weights)")
    named = str(folder) if what == "checkpoint" else f"{what} {folder}"
    steps = sorted((n for n in names if STEP_FOLDER.fullmatch(n) and (folder / n).is_dir()), key=lambda n: int(n[5:]))
    if steps:
        raise CheckpointError(
            f"{named} holds step folders ({', '.join(steps[-3:])}{', ...' if len(steps) > 3 else ''}) but none "
            f"is complete: none holds {METADATA_FILE} or {DCP_INDEX}"
        )
    raise CheckpointError(
        f"{named} is not a checkpoint (cannot tell the checkpoint format from its files): expected {_EXPECTED}"
    )


__all__ = ["DCP_FILES", "STEP_FOLDER", "Located", "complete_checkpoints", "locate", "step_of"]

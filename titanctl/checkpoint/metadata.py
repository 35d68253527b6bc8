"""What a titanctl checkpoint folder says about itself, beside the DCP files.

A step folder `{dump_folder}/{checkpoint.folder}/step-{N}/` holds plain DCP files plus
`titanctl.json`. The DCP state dict keeps the model's canonical (Meta) FQNs at the top
level, e.g. `layers.0.attention.wq.weight`, so a weights-only export and a full training
checkpoint share the model keys. A full checkpoint adds the top-level entries
`optimizer`, `lr_scheduler`, `dataloader`, `train_state` (step, tokens_seen) and `rng`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from titanctl.errors import CheckpointError
from titanctl.models.llama.args import ModelArgs, RopeScaling

METADATA_FILE = "titanctl.json"
FORMAT = "titanctl-dcp"
VERSION = 1


def write_metadata(folder: Path, args: ModelArgs, *, step: int, weights_only: bool, dtype: str, **extra: Any) -> None:
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "weights_only": weights_only,
        "dtype": dtype,
        "model_args": dataclasses.asdict(args),
        **extra,
    }
    tmp = folder / f".{METADATA_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, folder / METADATA_FILE)


def read_metadata(folder: Path) -> dict[str, Any]:
    path = Path(folder) / METADATA_FILE
    if not path.is_file():
        raise CheckpointError(f"{folder} is not a titanctl checkpoint: {METADATA_FILE} is missing")
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable or corrupt: {e}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def model_args_from_metadata(meta: dict[str, Any]) -> ModelArgs:
    raw = dict(meta["model_args"])
    if raw.get("rope_scaling") is not None:
        raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
    return ModelArgs(**raw)

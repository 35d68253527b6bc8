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

from titanctl.checkpoint.model_args import args_from_fields
from titanctl.errors import CheckpointError
from titanctl.models.llama.args import ModelArgs

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


# Fields every titanctl.json has, and the type each must have; optional ones are checked when present.
_REQUIRED = {"step": "count", "weights_only": "bool", "dtype": "str", "model_args": "dict"}
_OPTIONAL = {"tokens_seen": "count", "dp_degree": "positive", "global_batch_size": "positive",
             "world_size": "positive", "contents": "names", "checksums": "dict", "version": "count"}
_KINDS = {
    "count": ("a non-negative integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    "positive": ("a positive integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "dict": ("an object", lambda v: isinstance(v, dict)),
    "names": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
}


def read_metadata(folder: Path) -> dict[str, Any]:
    """titanctl.json of a step folder, its fields checked for type: one-line CheckpointError otherwise."""
    path = Path(folder) / METADATA_FILE
    try:
        if not path.is_file():
            raise CheckpointError(f"{folder} is not a titanctl checkpoint: {METADATA_FILE} is missing")
        text = path.read_text()
    except PermissionError:
        raise CheckpointError(f"cannot read {path}: permission denied") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        meta = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"{path} is unreadable or corrupt: {e}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} holds a JSON {type(meta).__name__}, expected an object")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {meta.get('format')!r}, expected {FORMAT!r}")
    for key, kind in (*_REQUIRED.items(), *_OPTIONAL.items()):
        if key not in meta:
            if key in _REQUIRED:
                raise CheckpointError(f"{path} lacks {key!r}")
            continue
        what, ok = _KINDS[kind]
        if not ok(meta[key]):
            raise CheckpointError(f"{path}: {key!r} is {meta[key]!r}, expected {what}")
    return meta


def model_args_from_metadata(meta: dict[str, Any], where: str = METADATA_FILE) -> ModelArgs:
    """The model a titanctl.json describes, checked (titanctl.checkpoint.model_args)."""
    return args_from_fields(meta.get("model_args"), where)

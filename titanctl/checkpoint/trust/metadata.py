"""What a titanctl checkpoint folder says about itself, beside the DCP files.

A step folder `{dump_folder}/{checkpoint.folder}/step-{N}/` holds plain DCP files plus
`titanctl.json`. The DCP state dict keeps the model's canonical (Meta) FQNs at the top
level, e.g. `layers.0.attention.wq.weight`, so a weights-only export and a full training
checkpoint share the model keys. A full checkpoint adds the top-level entries
`optimizer`, `lr_scheduler`, `dataloader`, `train_state` (step, tokens_seen) and `rng`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from titanctl.checkpoint.trust.model_args import args_from_fields
from titanctl.checkpoint.trust.paths import inside
from titanctl.errors import CheckpointCorrupt, CheckpointError
from titanctl.models.common.args import ModelArgs
from titanctl.safe_io import load_json, replace_atomically

METADATA_FILE = "titanctl.json"
RUN_CONFIG = "config.toml"  # the recipe a training step folder carries
FORMAT = "titanctl-dcp"
VERSION = 3  # 2: every titanctl.json records the checksum of every file of its folder (checksums.MANIFEST_SINCE)
FIELDS_SINCE = 3  # 3: ... and of its own fields (``checksums.fields``)
# titanctl.json holds the model's arguments, a few counters and one checksum per file: kilobytes.
MAX_METADATA_BYTES = 16 << 20


def write_metadata(folder: Path, args: ModelArgs, *, step: int, weights_only: bool, dtype: str, **extra: Any) -> None:
    meta = {
        "format": FORMAT,
        "version": VERSION if "checksums" in extra else 1,  # 1: no manifest, as before checksums
        "step": step,
        "weights_only": weights_only,
        "dtype": dtype,
        "model_args": dataclasses.asdict(args),
        **extra,
    }
    if "checksums" in extra:  # the manifest covers the file's own fields too (a rank edited in place)
        meta["checksums"] = {**extra["checksums"], "fields": fields_digest(meta)}
    # Never through a link the folder holds: a fresh temporary file renamed over the name.
    replace_atomically(folder / METADATA_FILE, json.dumps(meta, indent=1).encode(), what="checkpoint metadata",
                       error=CheckpointError)


# Fields every titanctl.json has, and the type each must have; optional ones are checked when present.
_REQUIRED = {"step": "count", "weights_only": "bool", "dtype": "str", "model_args": "dict"}
_OPTIONAL = {"tokens_seen": "count", "dp_degree": "positive", "global_batch_size": "positive",
             "world_size": "positive", "contents": "names", "checksums": "dict", "version": "count",
             "hf_config": "dict",  # hf_config: the Hugging Face config.json the weights came from
             "lora": "dict"}  # lora: a LoRA step's adapters and base (titanctl.checkpoint.lora.base)
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
    folder = Path(folder)
    if not os.path.lexists(folder / METADATA_FILE):
        raise CheckpointError(f"{folder} is not a titanctl checkpoint: {METADATA_FILE} is missing")
    # A link may point only inside the folder; the file must be small, UTF-8 and shallow JSON.
    path = inside(folder, METADATA_FILE, f"checkpoint {folder}")
    meta = load_json(path, what="checkpoint metadata", max_bytes=MAX_METADATA_BYTES, error=CheckpointError)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} holds a JSON {type(meta).__name__}, expected an object")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {_brief(meta.get('format'))}, expected {FORMAT!r}")
    for key, kind in (*_REQUIRED.items(), *_OPTIONAL.items()):
        if key not in meta:
            if key in _REQUIRED:
                raise CheckpointError(f"{path} lacks {key!r}")
            continue
        what, ok = _KINDS[kind]
        if not ok(meta[key]):
            raise CheckpointError(f"{path}: {key!r} is {_brief(meta[key])}, expected {what}")
    _verify_fields(meta, path)
    return meta


def fields_digest(meta: dict[str, Any]) -> str:
    """sha256 of every field of a titanctl.json but ``checksums`` (which holds it), in a canonical form."""
    fields = {key: value for key, value in meta.items() if key != "checksums"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _verify_fields(meta: dict[str, Any], path: Path) -> None:
    """The fields as saved: a titanctl.json of version FIELDS_SINCE or later records their checksum (as its
    manifest does the files'), so an edited rank, step or model argument is a damaged checkpoint."""
    entry = meta.get("checksums")
    if not isinstance(entry, dict):
        return  # no manifest at all: checksums.require_manifest says whether one must be there
    recorded, version = entry.get("fields"), meta.get("version", 1)
    if recorded is None and isinstance(version, int) and version >= FIELDS_SINCE:
        raise CheckpointCorrupt(f"{path} records no checksum of its own fields, but titanctl writes one from version "
                                f"{FIELDS_SINCE} on (this file says {version}): the file was altered")
    if recorded is not None and recorded != fields_digest(meta):
        raise CheckpointCorrupt(f"{path}: its fields do not match the sha256 checksum recorded when the checkpoint "
                                "was saved: the file was edited or damaged")


def _brief(value: Any, limit: int = 60) -> str:
    """A value from the file, cut so that a megabyte string makes no megabyte error line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({type(value).__name__} of {len(text):,} characters)"


def model_args_from_metadata(meta: dict[str, Any], where: str = METADATA_FILE) -> ModelArgs:
    """The model a titanctl.json describes, checked (titanctl.checkpoint.trust.model_args)."""
    return args_from_fields(meta.get("model_args"), where)

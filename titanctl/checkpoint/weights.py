"""Model weights for inference, from a checkpoint of any format that ``titanctl convert`` reads.

:func:`find_checkpoint` tells what a path holds (``titanctl.checkpoint.locate``: a checkpoint
folder, or a folder of step-N folders, whose newest complete one is taken) and reads the model it
declares, checked against the tensors the checkpoint stores (so a model built from it has the
checkpoint's size, whatever its JSON says):

| format       | the model comes from                                                     |
|--------------|--------------------------------------------------------------------------|
| `dcp`        | ``titanctl.json`` (a titanctl step folder; full training or weights-only) |
| `hf`         | ``config.json`` (its ``model_type`` picks the family)                     |
| `meta`       | ``params.json``                                                           |
| `torchtune`  | ``params.json`` or ``config.json``                                        |
| `torchtitan` | ``params.json`` or ``config.json`` (written by titanctl beside DCP files) |

A checkpoint without that file (``args`` None) takes its model from a recipe, or from its tensor
shapes when they are a published flavor's (:func:`with_model`). :func:`load_weights` fills a built
model, sharded or not: a titanctl DCP folder through ``titanctl.checkpoint.trust.reader`` (each rank
reads only its own shards; every shape checked and every checksum verified before a tensor is
used, as for resume), any other format through its ``Source`` (``titanctl.checkpoint.formats``)
and ``run.load_into_model``: each rank reads the full tensors one at a time and keeps its slice.
:func:`checkpoint_tokenizer` names the tokenizer file a checkpoint folder carries, if any.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from titanctl.checkpoint.formats import open_source
from titanctl.checkpoint.formats.hf import CONFIG_FILE as HF_CONFIG
from titanctl.checkpoint.formats.meta import PARAMS_FILE
from titanctl.checkpoint.hf.tokenizer_export import TIKTOKEN_FILE, TOKENIZER_JSON
from titanctl.checkpoint.locate import locate
from titanctl.checkpoint.run.load_into_model import load_source_into
from titanctl.checkpoint.run.load_plan import check_model
from titanctl.checkpoint.trust.metadata import METADATA_FILE, model_args_from_metadata
from titanctl.checkpoint.trust.model_args import check_declared
from titanctl.checkpoint.trust.paths import inside
from titanctl.checkpoint.trust.reader import DCPFolder
from titanctl.data.tokenizer import TOKENIZER_CONFIG
from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs

# The file that declares the model, per format (the first one present is read).
MODEL_FILES = {
    "dcp": (METADATA_FILE,),
    "hf": (HF_CONFIG,),
    "meta": (PARAMS_FILE,),
    "torchtune": (PARAMS_FILE, HF_CONFIG),
    "torchtitan": (PARAMS_FILE, HF_CONFIG),
}
_DESCRIBED = {
    "hf": "Hugging Face safetensors",
    "meta": "Meta consolidated.*.pth",
    "torchtune": "torchtune",
    "torchtitan": "torchtitan DCP",
}


@dataclass
class CheckpointSource:
    kind: str  # the format (titanctl.checkpoint.formats.FORMATS): "dcp" is titanctl's own
    folder: Path
    args: ModelArgs | None  # None: the checkpoint declares no model (see with_model)
    meta: dict[str, Any] = field(default_factory=dict)  # titanctl.json, when there is one
    origin: str = ""  # where args come from, e.g. "config.json" or "--config recipes/x.toml"
    step: int | None = None  # N when the folder is a step-N folder

    def describe(self) -> str:
        if self.kind != "dcp":
            return _DESCRIBED.get(self.kind, self.kind)
        if not self.meta:
            return "DCP"
        return f"DCP step {self.meta.get('step')}" + (" (weights only)" if self.meta.get("weights_only") else "")


def find_checkpoint(path: Path) -> CheckpointSource:
    """Tell what kind of checkpoint ``path`` is and read (and check) the model it declares."""
    located = locate(path, "checkpoint")
    folder, fmt = located.folder, located.format
    if fmt == "dcp":
        reader = DCPFolder(folder)
        where = str(folder / METADATA_FILE)
        args = model_args_from_metadata(reader.meta, where)
        rows = dict(reader.tensors()).get("tok_embeddings.weight", (None,))[0]
        check_declared(args, reader.tensors(), rows, where)
        return CheckpointSource("dcp", folder, args, reader.meta, METADATA_FILE, located.step)
    if not any((folder / name).is_file() for name in MODEL_FILES[fmt]):
        return CheckpointSource(fmt, folder, None, step=located.step)  # nothing opened yet
    with open_source(folder, fmt) as source:
        args, origin = source.own_args()
    return CheckpointSource(fmt, folder, args, origin=origin, step=located.step)


def with_model(source: CheckpointSource, recipe: ModelArgs | None = None, origin: str = "") -> CheckpointSource:
    """``source`` with its model settled when it declares none: the ``recipe``'s (from ``origin``)
    with the vocabulary of the checkpoint's embedding, else the published flavor its tensor shapes
    are (``titanctl.checkpoint.trust.shape_inference``). A source that declares its model is returned as is."""
    if source.args is not None:
        return source
    if source.kind == "dcp":  # find_checkpoint read its titanctl.json
        raise CheckpointError(f"{source.folder}: no model arguments read")
    named = " or ".join(MODEL_FILES[source.kind])
    hint = "pass --config RECIPE to say which model it holds"
    with open_source(source.folder, source.kind) as opened:
        if recipe is not None:
            args = recipe.replace(vocab_size=opened.vocab_size(recipe.dim))
        else:
            try:
                args, origin = opened.own_args()
            except CheckpointError as e:
                reason = str(e).removesuffix(": give --flavor or --config")
                raise CheckpointError(
                    f"{source.folder} has no {named} and its model cannot be told from its tensors ({reason}): {hint}"
                ) from None
            if args is None:
                raise CheckpointError(f"{source.folder} has no {named}: {hint}")
    return CheckpointSource(source.kind, source.folder, args, source.meta, origin, source.step)


def checkpoint_tokenizer(folder: Path) -> Path | None:
    """The tokenizer a checkpoint folder carries: ``tokenizer.json`` (Hugging Face's, read with the
    ``tokenizer_config.json`` beside it), else ``tokenizer.model`` (tiktoken's, Meta's); None when
    neither is there. A link that leads out of the folder is refused, as for every checkpoint file."""
    for name in (TOKENIZER_JSON, TIKTOKEN_FILE):
        if os.path.lexists(folder / name):
            path = inside(folder, name, f"checkpoint {folder}")
            if name == TOKENIZER_JSON and os.path.lexists(folder / TOKENIZER_CONFIG):
                inside(folder, TOKENIZER_CONFIG, f"checkpoint {folder}")
            return path
    return None


def load_weights(model: nn.Module, source: CheckpointSource) -> None:
    """Fill `model` (built for ``source.args``, possibly TP-sharded) with the checkpoint's weights."""
    if source.kind == "dcp":
        _load_dcp(model, source.folder)
    else:
        _load_source(model, source)


def _load_dcp(model: nn.Module, folder: Path) -> None:
    """Each rank reads its own shards of the model keys (other top-level entries are left alone)."""
    reader = DCPFolder(folder, require_titanctl=False)
    check_model(folder, reader.meta or {}, reader.entries, model.args)
    state = model.state_dict()
    reader.verify()
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    reader.load(state, no_dist=not distributed)


def _load_source(model: nn.Module, source: CheckpointSource) -> None:
    """Stream full tensors one at a time, renamed to titanctl's names; each rank keeps its slice
    (no communication)."""
    with open_source(source.folder, source.kind) as opened:
        opened.bind(model.args, source.origin or "the model")
        load_source_into(model, opened)

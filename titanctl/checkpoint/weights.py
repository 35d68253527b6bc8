"""Model weights for inference, from a titanctl DCP step folder or a Hugging Face folder.

:func:`find_checkpoint` tells what a path holds and reads the model it declares, checked
against the tensors the checkpoint stores (so a model built from it has the checkpoint's
size, whatever its JSON says): a titanctl DCP step folder (``titanctl.json`` gives the
model; full training or weights-only), a plain DCP folder (the model comes from a recipe),
a folder of step folders (the newest is taken), or a Hugging Face folder (``config.json`` +
safetensors). :func:`load_weights` fills a built model, sharded or not, through the same
readers as training resume and conversion (``titanctl.checkpoint.reader`` for DCP, the
Hugging Face ``Source`` for safetensors): every shape checked and every checksum verified
before a tensor is used (``load_plan.check_model`` for DCP, ``load_into_model`` for safetensors,
as for training). Under tensor parallel each rank reads only its DCP shards, or slices the full
tensors it streams from safetensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from titanctl.checkpoint.formats.hf import HFSource
from titanctl.checkpoint.load_into_model import load_source_into
from titanctl.checkpoint.load_plan import check_model
from titanctl.checkpoint.metadata import METADATA_FILE, model_args_from_metadata
from titanctl.checkpoint.model_args import check_declared
from titanctl.checkpoint.reader import DCP_INDEX, DCPFolder
from titanctl.errors import CheckpointError
from titanctl.models.llama.args import ModelArgs

_STEP_DIR = re.compile(r"step-(\d+)")
_HF_CONFIG = "config.json"


@dataclass
class CheckpointSource:
    kind: str  # "dcp" or "hf"
    folder: Path
    args: ModelArgs | None  # None: a plain DCP folder, the model comes from a recipe
    meta: dict[str, Any] = field(default_factory=dict)  # titanctl.json, when there is one

    def describe(self) -> str:
        if self.kind == "hf":
            return "Hugging Face safetensors"
        if not self.meta:
            return "DCP"
        return f"DCP step {self.meta.get('step')}" + (" (weights only)" if self.meta.get("weights_only") else "")


def find_checkpoint(path: Path) -> CheckpointSource:
    """Tell what kind of checkpoint ``path`` is and read (and check) its model arguments."""
    folder = Path(path)
    try:
        if not folder.is_dir():
            raise CheckpointError(f"checkpoint {folder} does not exist or is not a folder")
        names = {p.name for p in folder.iterdir()}
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {folder}: {e.strerror or e}") from None
    if METADATA_FILE in names:
        reader = DCPFolder(folder)
        where = str(folder / METADATA_FILE)
        args = model_args_from_metadata(reader.meta, where)
        rows = dict(reader.tensors()).get("tok_embeddings.weight", (None,))[0]
        check_declared(args, reader.tensors(), rows, where)
        return CheckpointSource("dcp", folder, args, reader.meta)
    if _HF_CONFIG in names:
        if not any(name.endswith(".safetensors") for name in names):
            raise CheckpointError(f"{folder} has a config.json but no *.safetensors files")
        source = HFSource(folder)
        args, _ = source.own_args()
        return CheckpointSource("hf", folder, args)
    if DCP_INDEX in names:
        return CheckpointSource("dcp", folder, None)
    steps = [
        (int(m.group(1)), folder / name) for name in names
        if (m := _STEP_DIR.fullmatch(name)) and (folder / name / METADATA_FILE).is_file()
    ]
    if steps:
        return find_checkpoint(max(steps)[1])
    raise CheckpointError(
        f"{folder} is not a checkpoint: expected a DCP step folder (titanctl.json + .metadata), a folder of "
        "step-N folders, or a Hugging Face folder (config.json + *.safetensors)"
    )


def load_weights(model: nn.Module, source: CheckpointSource) -> None:
    """Fill `model` (built for ``source.args``, possibly TP-sharded) with the checkpoint's weights."""
    if source.kind == "hf":
        _load_hf(model, source.folder)
    else:
        _load_dcp(model, source.folder)


def _load_dcp(model: nn.Module, folder: Path) -> None:
    """Each rank reads its own shards of the model keys (other top-level entries are left alone)."""
    reader = DCPFolder(folder, require_titanctl=False)
    check_model(folder, reader.meta or {}, reader.entries, model.args)
    state = model.state_dict()
    reader.verify()
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    reader.load(state, no_dist=not distributed)


def _load_hf(model: nn.Module, folder: Path) -> None:
    """Stream full tensors one at a time; each rank keeps its slice (no communication)."""
    with HFSource(folder) as source:
        source.bind(model.args, _HF_CONFIG)
        load_source_into(model, source)

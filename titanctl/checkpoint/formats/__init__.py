"""Checkpoint formats: each a streaming ``Source`` (reader) and a ``write`` function.

| format      | folder holds                                                    |
|-------------|-----------------------------------------------------------------|
| `meta`      | `params.json` + `consolidated.NN.pth` (model-parallel shards)    |
| `dcp`       | DCP files + `.metadata` (+ `titanctl.json`)                      |
| `hf`        | `*.safetensors` (+ index, + `config.json` unless --flavor/shapes)  |
| `torchtune` | `model-00001-of-00001.bin` / `*.pt` with torchtune's key names   |
| `torchtitan`| DCP files + `.metadata`, no `titanctl.json` (torchtitan's names) |
"""

from __future__ import annotations

import re
from pathlib import Path

from titanctl.checkpoint.formats import dcp, hf, meta, torchtitan, torchtune
from titanctl.checkpoint.formats.base import FORMATS, DictSource, Source, TensorInfo, peek_keys, torch_weight_files
from titanctl.checkpoint.formats.meta import PARAMS_FILE
from titanctl.checkpoint.trust.metadata import METADATA_FILE
from titanctl.checkpoint.trust.reader import DCP_INDEX
from titanctl.errors import CheckpointError

SOURCES: dict[str, type[Source]] = {
    "meta": meta.MetaSource,
    "dcp": dcp.DCPSource,
    "hf": hf.HFSource,
    "torchtune": torchtune.TorchtuneSource,
    "torchtitan": torchtitan.TorchtitanSource,
}
WRITERS = {
    "meta": meta.write,
    "dcp": dcp.write,
    "hf": hf.write,
    "torchtune": torchtune.write,
    "torchtitan": torchtitan.write,
}
_CONSOLIDATED = re.compile(r"consolidated\.\d+\.pth")


def naming(keys: list[str]) -> str | None:
    """Which format's names these tensor names are (None: none of ours)."""
    if any(k.startswith("model.") or k == "lm_head.weight" for k in keys):
        return "hf"
    if any(".attn." in k or k.endswith(("sa_norm.scale", "mlp_norm.scale")) or k == "norm.scale" for k in keys):
        return "torchtune"
    if any(".attention." in k or ".feed_forward." in k or k in ("norm.weight", "tok_embeddings.weight") for k in keys):
        return "meta"
    return None


def detect(folder: Path) -> str:
    """The format of a checkpoint folder, from the files in it."""
    folder = Path(folder)
    names = {p.name for p in folder.iterdir()}
    if METADATA_FILE in names:
        return "dcp"
    if DCP_INDEX in names:  # DCP without titanctl's metadata: torchtitan's (any version's names)
        return "torchtitan"
    if PARAMS_FILE in names and any(_CONSOLIDATED.fullmatch(n) for n in names):
        return "meta"
    if any(n.endswith(".safetensors") for n in names):
        if hf.CONFIG_FILE in names or hf.holds_hf_names(folder):
            return "hf"
    weight_files = torch_weight_files(folder)
    if weight_files:
        found = naming(peek_keys(weight_files[0]))
        if found == "hf":
            raise CheckpointError(
                f"{weight_files[0]} holds Hugging Face names in PyTorch .bin/.pt form: "
                "only safetensors Hugging Face checkpoints are read (save_pretrained them as safetensors)"
            )
        if found is not None:
            return found
    raise CheckpointError(
        f"cannot tell the checkpoint format of {folder}: expected params.json + consolidated.*.pth (meta), "
        "titanctl.json + .metadata (dcp), .metadata alone (torchtitan), *.safetensors with Hugging Face names (hf) "
        "or a torchtune .bin/.pt; give --from"
    )


def open_source(folder: Path, fmt: str) -> Source:
    if fmt not in SOURCES:
        raise CheckpointError(f"unknown checkpoint format {fmt!r}; valid: {', '.join(FORMATS)}")
    return SOURCES[fmt](Path(folder))


__all__ = ["FORMATS", "SOURCES", "WRITERS", "DictSource", "Source", "TensorInfo", "detect", "naming", "open_source"]

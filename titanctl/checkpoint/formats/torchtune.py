"""torchtune's own format: the key names its Llama 3 builders (``llama3_1_8b`` ...) expect.

torchtune keeps Meta's interleaved RoPE layout, so this is renames only (``attn.q_proj``,
``attn.output_proj``, ``sa_norm.scale``, ``mlp_norm.scale``, ``mlp.w1/w2/w3``,
``norm.scale``; ``tok_embeddings`` and ``output`` unchanged). Files are what torchtune's
``FullModelTorchTuneCheckpointer`` reads and writes: one ``torch.save`` of the flat state
dict, ``model-00001-of-00001.bin`` (older releases: ``torchtune_model_{epoch}.pt``).
torchtune copies the source's config files beside it; titanctl writes ``params.json``
(Meta's keys), which is also what it reads first (then ``config.json``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from titanctl.checkpoint.formats.base import (
    Progress,
    Source,
    TensorInfo,
    TorchFiles,
    cast,
    check_complete,
    read_json,
    torch_weight_files,
)
from titanctl.checkpoint.formats.meta import PARAMS_FILE, args_from_params, params_from_args
from titanctl.checkpoint.hf.names import args_from_hf_config
from titanctl.checkpoint.trust.model_args import check_declared
from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs
from titanctl.models.registry import all_specs

WEIGHTS_FILE = "model-00001-of-00001.bin"
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def _names() -> tuple[dict[str, str], dict[str, str]]:
    """(per-layer suffixes, top-level names): titanctl -> torchtune, of the family that has the format."""
    (spec,) = [spec for spec in all_specs() if spec.torchtune_names is not None]
    return spec.torchtune_names


def to_tune_name(name: str) -> str:
    layer_names, top_names = _names()
    if name in top_names:
        return top_names[name]
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in layer_names:
        return f"layers.{m.group(1)}.{layer_names[m.group(2)]}"
    raise CheckpointError(f"unknown titanctl tensor {name!r}")


def from_tune_name(name: str) -> str | None:
    layer_names, top_names = _names()
    top = {theirs: ours for ours, theirs in top_names.items()}
    if name in top:
        return top[name]
    m = _LAYER.fullmatch(name)
    layer = {theirs: ours for ours, theirs in layer_names.items()}
    if m and m.group(2) in layer:
        return f"layers.{m.group(1)}.{layer[m.group(2)]}"
    return None


def find_files(folder: Path) -> list[Path]:
    files = torch_weight_files(folder)
    if not files:
        raise CheckpointError(f"{folder} has no .bin/.pt weight file: not a torchtune checkpoint")
    return files


class TorchtuneSource(Source):
    format = "torchtune"

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.paths = find_files(self.folder)
        self.files = TorchFiles(self.paths)
        self._where: dict[str, tuple[Path, str]] = {}  # canonical name -> (file, torchtune key)

    def own_args(self) -> tuple[ModelArgs | None, str]:
        if (self.folder / PARAMS_FILE).is_file():
            where = str(self.folder / PARAMS_FILE)
            args = args_from_params(read_json(self.folder / PARAMS_FILE), where)
            if args.vocab_size <= 0:
                args = args.replace(vocab_size=self.vocab_size(args.dim))
            name = PARAMS_FILE
        elif (self.folder / "config.json").is_file():  # copied by torchtune from a Hugging Face source
            where = str(self.folder / "config.json")
            args, name = args_from_hf_config(read_json(self.folder / "config.json"), where=where), "config.json"
        else:
            return None, f"{PARAMS_FILE} or config.json"
        stored = [(key, tuple(t.shape)) for sd in self.files.files.values() for key, t in sd.items()]
        check_declared(args, stored, self.embedding_rows(args.dim), where)
        return args, name

    def vocab_size(self, dim: int) -> int:
        for sd in self.files.files.values():
            emb = sd.get("tok_embeddings.weight")
            if emb is not None and emb.ndim == 2:
                return emb.shape[0]
        raise CheckpointError(f"{self.folder} has no 2-D 'tok_embeddings.weight'")

    def bind(self, args: ModelArgs, origin: str) -> None:
        self.args = args
        infos = []
        for path, sd in self.files.files.items():
            for key, tensor in sd.items():
                name = from_tune_name(key)
                if name is None:
                    raise CheckpointError(f"{path.name}: unknown tensor {key!r} (not a torchtune Llama 3 weight)")
                self._where[name] = (path, key)
                infos.append(TensorInfo(name, tuple(tensor.shape), tensor.dtype, key, path.name))
        check_complete(infos, args, origin, self.folder)
        self.infos = infos

    def load(self, name: str) -> torch.Tensor:
        path, key = self._where[name]
        return self.files.pages.copy_out(self.files.files[path][key])

    def close(self) -> None:
        self.files.close()


def write(folder: Path, args: ModelArgs, source: Source, *, dtype: torch.dtype | None, progress: Progress) -> None:
    """One file, as torchtune's checkpointer reads it (so the whole model is in memory once)."""
    tensors = {}
    for info in source.infos:
        tensors[to_tune_name(info.name)] = cast(source.load(info.name), dtype)
        progress(info.name, tensors[to_tune_name(info.name)].nbytes)
    torch.save(tensors, folder / WEIGHTS_FILE)
    del tensors
    (folder / PARAMS_FILE).write_text(json.dumps(params_from_args(args), indent=2) + "\n")

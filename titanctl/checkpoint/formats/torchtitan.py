"""torchtitan's DCP checkpoints (``{dump_folder}/checkpoint/step-N/``), read and written.

torchtitan's ``CheckpointManager`` hands DCP one flat dict: the model's state dict at the
top level (its FQNs, e.g. ``tok_embeddings.weight``), beside the top-level entries
``optimizer``, ``lr_scheduler``, ``dataloader`` and ``train_state`` of a full training
checkpoint. A weights-only checkpoint (step 0, or ``last_save_model_only``) holds the
model alone; an ``initial_load_path`` is loaded model-only by default, and only the model
keys must be present. Nothing in the folder says which model it is.

Two naming generations, told apart by the names themselves:

| torchtitan | attention projections                      | output          |
|------------|--------------------------------------------|-----------------|
| <= 0.2     | ``layers.N.attention.wq.weight`` (wk, wv)  | ``output.weight`` |
| 0.3        | ``layers.N.attention.qkv_linear.wq.weight`` | ``lm_head.weight`` |

0.3 computes q/k/v with one fused ``wqkv`` matrix but saves and loads it split into
``qkv_linear.{wq,wk,wv}`` (state-dict hooks), so those are the names on disk. Everything
else is titanctl's canonical (Meta) naming, and both keep Meta's interleaved RoPE rows:
reading and writing is renaming only. Written Llama output uses the 0.3 names, plus a
``params.json`` (Meta's keys) that torchtitan ignores and titanctl reads back.

Other families (Qwen3, Qwen3-MoE, DeepSeek-V3: torchtitan's MoE and latent attention modules have
titanctl's names) are saved by torchtitan under titanctl's canonical names, with the published
weights' RoPE rows ("rotate half", DeepSeek's interleaved): written as they are, plus the Hugging Face
``config.json`` (Meta's keys cannot say QK norm, head width, FFN width or the tie), which
titanctl reads back. A tied model's output layer is written as the embedding's copy (torchtitan's
loader wants both keys) while config.json says tied, so reading drops the copy again.

Reading goes through :class:`DCPSource` (the same DCP reader as titanctl's own format);
the training state is skipped without being read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titanctl.checkpoint.formats.base import (
    DERIVED_BUFFERS,
    Progress,
    Source,
    TensorInfo,
    UntiedView,
    check_complete,
    dtype_name,
    read_json,
)
from titanctl.checkpoint.formats.dcp import TRAINING_STATE, DCPSource, save_streaming
from titanctl.checkpoint.formats.hf import CONFIG_FILE
from titanctl.checkpoint.formats.meta import PARAMS_FILE, args_from_params, params_from_args
from titanctl.checkpoint.hf_names import args_from_hf_config, hf_config
from titanctl.checkpoint.metadata import METADATA_FILE
from titanctl.checkpoint.shape_inference import infer_model_args
from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs
from titanctl.models.registry import spec_of

_QKV_03 = re.compile(r"layers\.(\d+)\.attention\.qkv_linear\.(wq|wk|wv)\.weight")
_QKV = re.compile(r"layers\.(\d+)\.attention\.(wq|wk|wv)\.weight")
OUTPUT_03 = "lm_head.weight"


def naming_version(keys: list[str]) -> str:
    """'0.3' when the names are torchtitan 0.3's, else '<=0.2' (= titanctl's canonical names)."""
    if any(k == OUTPUT_03 or _QKV_03.fullmatch(k) for k in keys):
        return "0.3"
    return "<=0.2"


def from_torchtitan_name(key: str) -> str:
    """A torchtitan (0.3 or earlier) tensor name -> titanctl's canonical name."""
    if key == OUTPUT_03:
        return "output.weight"
    m = _QKV_03.fullmatch(key)
    if m:
        return f"layers.{m.group(1)}.attention.{m.group(2)}.weight"
    return key


def to_torchtitan_name(name: str) -> str:
    """A canonical name -> the name torchtitan 0.3 saves and loads."""
    if name == "output.weight":
        return OUTPUT_03
    m = _QKV.fullmatch(name)
    if m:
        return f"layers.{m.group(1)}.attention.qkv_linear.{m.group(2)}.weight"
    return name


def model_keys(entries: dict) -> list[str]:
    """The stored names of a DCP folder that are not training state or derived buffers."""
    return [k for k in entries if k.split(".", 1)[0] not in TRAINING_STATE and k not in DERIVED_BUFFERS]


class TorchtitanSource(DCPSource):
    format = "torchtitan"

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        keys = model_keys(self.entries)
        self.version = naming_version(keys)
        names = "0.3 names (attention.qkv_linear.*, lm_head)" if self.version == "0.3" else "<= 0.2 names"
        self.notes.append(f"torchtitan {names}")
        ignored = sorted({k.split(".", 1)[0] for k in self.entries} & set(TRAINING_STATE))
        if ignored:
            self.notes.append(f"full training checkpoint: model weights taken; {', '.join(ignored)} ignored")

    def own_args(self) -> tuple[ModelArgs | None, str]:
        config = self.folder / CONFIG_FILE
        if config.is_file():  # written by titanctl beside the DCP files of a family other than Llama
            return args_from_hf_config(read_json(config), where=str(config)), CONFIG_FILE
        path = self.folder / PARAMS_FILE
        if path.is_file():  # written by titanctl beside the DCP files
            args = args_from_params(read_json(path), str(path))
            if args.vocab_size <= 0:
                args = args.replace(vocab_size=self.vocab_size(args.dim))
            return args, PARAMS_FILE
        return infer_model_args(self._canonical_shapes(), str(self.folder))

    def _canonical_shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            from_torchtitan_name(k): tuple(entry.size)
            for k in model_keys(self.entries)
            if isinstance(entry := self.entries[k], TensorStorageMetadata)
        }

    def bind(self, args: ModelArgs, origin: str) -> None:
        self.args = args
        infos = []
        for key in model_keys(self.entries):
            entry = self.entries[key]
            if not isinstance(entry, TensorStorageMetadata):
                raise CheckpointError(f"{self.folder}: entry {key!r} is not a tensor (not a weight of this model)")
            infos.append(TensorInfo(from_torchtitan_name(key), tuple(entry.size), entry.properties.dtype, key,
                                    str(self.folder)))
        check_complete(infos, args, origin, self.folder)
        self.infos = infos

    def extra_metadata(self) -> dict:
        return {}  # torchtitan's step lives in train_state as pickled bytes: never unpickled here


def is_torchtitan(folder: Path) -> bool:
    """A DCP folder that is not titanctl's own (no titanctl.json): torchtitan's, whatever its version."""
    return (Path(folder) / ".metadata").is_file() and not (Path(folder) / METADATA_FILE).is_file()


def write(folder: Path, args: ModelArgs, source: Source, *, dtype: torch.dtype | None, progress: Progress) -> None:
    """torchtitan's layout: model weights flat at the top level; Llama under 0.3's names with a
    params.json, another family under canonical names with a Hugging Face config.json."""
    if spec_of(args).torchtitan_renamed:
        save_streaming(folder, source, dtype=dtype, progress=progress, stored_name=to_torchtitan_name)
        (folder / PARAMS_FILE).write_text(json.dumps(params_from_args(args), indent=2) + "\n")
        return
    save_streaming(folder, source, dtype=dtype, progress=progress)
    described = source.source.args if isinstance(source, UntiedView) else args  # a tied model says so
    dtypes = sorted({dtype_name(dtype or info.dtype) for info in source.infos})
    config = hf_config(described, torch_dtype=dtypes[0] if len(dtypes) == 1 else "float32")
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

"""torchtitan's DCP checkpoints (``{dump_folder}/checkpoint/step-N/``), read and written.

torchtitan's ``CheckpointManager`` hands DCP one flat dict: the model's state dict at the
top level (its FQNs, e.g. ``tok_embeddings.weight``), beside the top-level entries
``optimizer``, ``lr_scheduler``, ``dataloader`` and ``train_state`` of a full training
checkpoint. A weights-only checkpoint (step 0, or ``last_save_model_only``) holds the
model alone; an ``initial_load_path`` is loaded model-only by default, and only the model
keys must be present. Nothing in the folder says which model it is.

Two naming generations, told apart by the names themselves. Up to 0.2 torchtitan's names are
titanctl's. 0.3 renamed some (each family's ``ModelSpec.torchtitan`` says which; the shared pieces
are in ``titanctl.models.common.torchtitan_names``):

- ``layers.N.attention.{wq,wk,wv}.weight`` -> ``layers.N.attention.qkv_linear.{wq,wk,wv}.weight``
  (grouped-query attention; DeepSeek's latent attention keeps its ``wq``)
- ``layers.N.moe.experts.{w1,w2,w3}`` -> ``layers.N.moe.routed_experts.inner_experts.{w1_EFD,w2_EDF,w3_EFD}``
  (the same shapes), ``layers.N.moe.expert_bias`` -> ``layers.N.moe.expert_bias_E``
- gpt-oss: ``attention.{wq,wk,wv}.bias`` -> ``attention.qkv_linear.{wq,wk,wv}.bias``; the experts
  ``moe.experts.{w13,b13,w2,b2}`` -> ``moe.routed_experts.inner_experts.{mlp1_weight_EGD,mlp1_bias_EG,
  mlp2_weight_EDF,mlp2_bias_ED}`` (the same shapes, gate and up rows interleaved in both)
- multi-token prediction depth k: its block ``layers.{n_layers + k}.*`` -> ``mtp_layers.{k}.*``,
  ``mtp.{k}.{enorm,hnorm,eh_proj,norm}`` -> ``mtp_layers.{k}.{enorm,hnorm,eh_proj,mtp_norm}``
- ``output.weight`` -> ``lm_head.weight``

0.3 computes q/k/v with one fused ``wqkv`` matrix but saves and loads it split into
``qkv_linear.{wq,wk,wv}`` (state-dict hooks), so those are the names on disk. Layouts are the same
(Meta's interleaved RoPE rows for Llama and DeepSeek-V3, "rotate half" for Qwen3, experts stacked
[E, ...]): reading and writing is renaming only. Output is written under 0.3's names, with a file
torchtitan ignores and titanctl reads back: Meta's ``params.json`` for Llama, the Hugging Face
``config.json`` for the other families (Meta's keys cannot say QK norm, head width, FFN width, experts
or the tie). A tied model's output layer is written as the embedding's copy (torchtitan's loader
wants both keys) while config.json says tied, so reading drops the copy again.

Reading goes through :class:`DCPSource` (the same DCP reader as titanctl's own format);
the training state is skipped without being read.
"""

from __future__ import annotations

import functools
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
    written_dtype,
)
from titanctl.checkpoint.formats.dcp import TRAINING_STATE, DCPSource, save_streaming
from titanctl.checkpoint.formats.hf import CONFIG_FILE
from titanctl.checkpoint.formats.meta import PARAMS_FILE, args_from_params, params_from_args
from titanctl.checkpoint.hf.names import args_from_hf_config, hf_config
from titanctl.checkpoint.trust.metadata import METADATA_FILE
from titanctl.checkpoint.trust.shape_inference import infer_model_args
from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs
from titanctl.models.registry import all_specs, spec_of

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_MTP = re.compile(r"mtp\.(\d+)\.(.+)")
_TT_MTP = re.compile(r"mtp_layers\.(\d+)\.(.+)")
# How a note shows which of 0.3's renamings a checkpoint holds: (part of a stored name, shown as).
_RENAMED_PARTS = (
    (".qkv_linear.", "attention.qkv_linear.*"),
    (".routed_experts.", "moe.routed_experts.*"),
    (".expert_bias_E", "moe.expert_bias_E"),
    ("mtp_layers.", "mtp_layers.*"),
    ("lm_head.", "lm_head"),
)


def to_torchtitan_name(name: str, args: ModelArgs) -> str:
    """A canonical name of the model ``args`` -> the name torchtitan 0.3 saves and loads."""
    names = spec_of(args).torchtitan
    assert names is not None, f"{args.family} has no torchtitan names"  # convert refuses such a family earlier
    if name in names.top_names:
        return names.top_names[name]
    if m := _LAYER.fullmatch(name):
        layer, suffix = int(m.group(1)), names.layer_names.get(m.group(2), m.group(2))
        if layer >= args.n_layers:  # a prediction depth's block
            return f"mtp_layers.{layer - args.n_layers}.{suffix}"
        return f"layers.{layer}.{suffix}"
    if m := _MTP.fullmatch(name):
        return f"mtp_layers.{m.group(1)}.{names.mtp_names[m.group(2)]}"
    return name


@functools.cache
def _renamed() -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """torchtitan 0.3's names -> titanctl's, of every family: (layer suffixes, top-level names, prediction
    depth suffixes). Read before the model is known, so one stored name must mean one canonical name."""
    layer: dict[str, str] = {}
    top: dict[str, str] = {}
    mtp: dict[str, str] = {}
    for spec in all_specs():
        if spec.torchtitan is None:
            continue
        for reverse, table in ((layer, spec.torchtitan.layer_names), (top, spec.torchtitan.top_names),
                               (mtp, spec.torchtitan.mtp_names)):
            for ours, theirs in table.items():
                assert reverse.setdefault(theirs, ours) == ours, f"torchtitan's {theirs} means two titanctl names"
    return layer, top, mtp


def canonical_names(keys: list[str]) -> dict[str, str]:
    """torchtitan's stored names (0.3's, or <= 0.2's = titanctl's) -> titanctl's canonical names. A name
    neither knows is kept as it is (the completeness check names it)."""
    layer, top, mtp = _renamed()
    main_layers = 1 + max((int(m.group(1)) for k in keys if (m := _LAYER.fullmatch(k))), default=-1)
    out = {}
    for key in keys:
        if key in top:
            out[key] = top[key]
        elif m := _LAYER.fullmatch(key):
            out[key] = f"layers.{m.group(1)}.{layer.get(m.group(2), m.group(2))}"
        elif m := _TT_MTP.fullmatch(key):
            depth, suffix = int(m.group(1)), m.group(2)
            if suffix in mtp:
                out[key] = f"mtp.{depth}.{mtp[suffix]}"
            else:  # the depth's block, after the main layers
                out[key] = f"layers.{main_layers + depth}.{layer.get(suffix, suffix)}"
        else:
            out[key] = key
    return out


def model_keys(entries: dict) -> list[str]:
    """The stored names of a DCP folder that are not training state or derived buffers."""
    return [k for k in entries if k.split(".", 1)[0] not in TRAINING_STATE and k not in DERIVED_BUFFERS]


class TorchtitanSource(DCPSource):
    format = "torchtitan"

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        keys = model_keys(self.entries)
        self.canonical = canonical_names(keys)  # stored name -> titanctl's
        # 0.3 when some name is 0.3's own, else <= 0.2 (whose names are titanctl's).
        self.version = "0.3" if any(self.canonical[k] != k for k in keys) else "<=0.2"
        if self.version == "0.3":
            parts = [shown for part, shown in _RENAMED_PARTS if any(part in key for key in keys)]
            self.notes.append(f"torchtitan 0.3 names ({', '.join(parts)})")
        else:
            self.notes.append("torchtitan <= 0.2 names")
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
            self.canonical[k]: tuple(entry.size)
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
            infos.append(TensorInfo(self.canonical[key], tuple(entry.size), entry.properties.dtype, key,
                                    str(self.folder)))
        check_complete(infos, args, origin, self.folder)
        self.infos = infos

    def extra_metadata(self) -> dict:
        return {}  # torchtitan's step lives in train_state as pickled bytes: never unpickled here


def is_torchtitan(folder: Path) -> bool:
    """A DCP folder that is not titanctl's own (no titanctl.json): torchtitan's, whatever its version."""
    return (Path(folder) / ".metadata").is_file() and not (Path(folder) / METADATA_FILE).is_file()


def write(folder: Path, args: ModelArgs, source: Source, *, dtype: torch.dtype | None, progress: Progress) -> None:
    """torchtitan 0.3's layout: model weights flat at the top level under its names, beside Meta's
    params.json (Llama) or a Hugging Face config.json (the other families)."""
    save_streaming(folder, source, dtype=dtype, progress=progress,
                   stored_name=lambda name: to_torchtitan_name(name, args))
    if "meta" in spec_of(args).formats:  # Meta's params.json can say only a model that Meta's format holds
        (folder / PARAMS_FILE).write_text(json.dumps(params_from_args(args), indent=2) + "\n")
        return
    described = source.source.args if isinstance(source, UntiedView) else args  # a tied model says so
    dtypes = sorted({dtype_name(written_dtype(info.dtype, dtype)) for info in source.infos
                     if info.dtype.is_floating_point})
    config = hf_config(described, torch_dtype=dtypes[0] if len(dtypes) == 1 else "float32")
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

"""titanctl's own format: a ``torch.distributed.checkpoint`` folder plus ``titanctl.json``.

The contract is ``titanctl.checkpoint.trust.metadata``: model weights under their canonical
names at the top level; a training step folder also holds ``optimizer``,
``lr_scheduler``, ``dataloader``, ``train_state`` and ``rng``, which conversion skips
without reading. Tensors of a Hugging Face folder that are no part of the model (``hf.hub_layout``: a
vision-language folder's vision encoder and prediction head) lie apart from it, under
``hf_carried.<their stored name>``, in their own dtype: conversion carries them on as they are
(``Source.carried``). No process group is needed on either side.

Reading goes through ``titanctl.checkpoint.trust.reader`` (the allow-listed ``.metadata``, paths
and sizes checked, checksums verified before the first tensor is read) and loads a few
tensors at a time through a partial state dict; writing hands DCP placeholder
(meta-device) tensors and produces each real tensor only when DCP asks for it, one file
per tensor, so neither side holds the model. A written folder records the checksums of
its files in ``titanctl.json``, as training checkpoints do.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem

from titanctl.checkpoint.formats.base import (
    DERIVED_BUFFERS,
    Progress,
    Source,
    TensorInfo,
    cast,
    check_complete,
    dtype_name,
    written_dtype,
)
from titanctl.checkpoint.hf.carried_config import HF_CONFIG_KEY
from titanctl.checkpoint.hf.hub_layout import CARRIED_PART
from titanctl.checkpoint.hf.names import HF_FILES_KEY
from titanctl.checkpoint.trust.checksums import ChecksumWriter, digest_files, record
from titanctl.checkpoint.trust.metadata import METADATA_FILE, model_args_from_metadata, write_metadata
from titanctl.checkpoint.trust.model_args import check_declared
from titanctl.checkpoint.trust.reader import DCP_INDEX, DCPFolder, first_failure, one_line, quiet_dcp
from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs

# Top-level entries of a full training checkpoint besides the model (metadata.py's contract).
TRAINING_STATE = ("optimizer", "lr_scheduler", "dataloader", "train_state", "rng", "diloco", "reference")
GROUP_BYTES = 256 * 2**20  # tensors read per DCP load call (a tensor larger than this goes alone)


class DCPSource(Source):
    format = "dcp"

    def __init__(self, folder: Path, group_bytes: int = GROUP_BYTES) -> None:
        super().__init__(folder)
        if not (self.folder / DCP_INDEX).is_file():
            if (self.folder / METADATA_FILE).is_file():
                raise CheckpointError(f"{self.folder} has {METADATA_FILE} but no DCP {DCP_INDEX}: incomplete")
            raise CheckpointError(f"{self.folder} has no DCP {DCP_INDEX}: not a DCP checkpoint")
        self.reader = DCPFolder(self.folder, require_titanctl=False)
        self.entries = self.reader.entries
        self.meta = self.reader.meta
        lora = (self.meta or {}).get("lora")  # a LoRA step: titanctl.checkpoint.lora.base
        if isinstance(lora, dict):
            base = lora["base"].get("path") if isinstance(lora.get("base"), dict) else None
            raise CheckpointError(
                f"{self.folder} holds LoRA adapters only (trained on the base {base}), not a whole model: merge "
                f"them into it first (titanctl convert {self.folder} OUT --merge-lora), or export them with --to peft"
            )
        self.group_bytes = group_bytes
        self.carried = carried_infos(self.entries, str(self.folder))
        self._cache: dict[str, torch.Tensor] = {}
        self.reads = 0  # DCP load calls made (tests check that reads are grouped)

    def own_args(self) -> tuple[ModelArgs | None, str]:
        if self.meta is None:
            return None, METADATA_FILE
        where = str(self.folder / METADATA_FILE)
        args = model_args_from_metadata(self.meta, where)
        model = ((name, shape) for name, shape in self.reader.tensors() if not is_carried(name))
        check_declared(args, model, self.embedding_rows(args.dim), where)
        return args, METADATA_FILE

    def vocab_size(self, dim: int) -> int:
        entry = self.entries.get("tok_embeddings.weight")
        if not isinstance(entry, TensorStorageMetadata) or len(entry.size) != 2:
            raise CheckpointError(f"{self.folder} has no 2-D 'tok_embeddings.weight'")
        return int(entry.size[0])

    def bind(self, args: ModelArgs, origin: str) -> None:
        self.args = args
        infos = []
        for key, entry in self.entries.items():
            if key.split(".", 1)[0] in TRAINING_STATE or key in DERIVED_BUFFERS or is_carried(key):
                continue
            if not isinstance(entry, TensorStorageMetadata):
                raise CheckpointError(f"{self.folder}: entry {key!r} is not a tensor (not a weight of this model)")
            infos.append(TensorInfo(key, tuple(entry.size), entry.properties.dtype, key, str(self.folder)))
        check_complete(infos, args, origin, self.folder)
        self.infos = infos
        self.reader.verify()  # every file against its checksum, before the first tensor is read

    def extra_metadata(self) -> dict[str, Any]:
        """The step, and the Hugging Face config.json the weights came from (``hf.carried_config``) and
        that folder's files (``hf.HF_FILES_KEY``)."""
        meta = self.meta or {}
        kinds = {"step": int, HF_CONFIG_KEY: dict, HF_FILES_KEY: dict}
        return {key: meta[key] for key, kind in kinds.items() if isinstance(meta.get(key), kind)}

    def _read_group(self, first: str) -> None:
        order = [i.name for i in self.infos]
        group: dict[str, torch.Tensor] = {}  # stored name -> tensor to fill
        names: dict[str, str] = {}  # stored name -> canonical name (they differ in subclasses)
        size = 0
        for name in order[order.index(first) :]:
            if name in self._cache:
                continue
            info = self.info(name)
            if group and size + info.nbytes() > self.group_bytes:
                break
            group[info.shown] = torch.empty(info.shape, dtype=info.dtype)  # read by its stored name
            names[info.shown] = name
            size += info.nbytes()
        self.reader.load(group)
        self.reads += 1
        self._cache.update((names[key], tensor) for key, tensor in group.items())

    def load(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            self._read_group(name)
        return self._cache.pop(name)

    def load_carried(self, name: str) -> torch.Tensor:
        info = next(info for info in self.carried if info.name == name)
        tensor = {info.shown: torch.empty(info.shape, dtype=info.dtype)}
        self.reader.load(tensor)
        self.reads += 1
        return tensor[info.shown]

    def close(self) -> None:
        self._cache.clear()


def carried_key(name: str) -> str:
    """The DCP entry of a carried tensor (``Source.carried``) stored as ``name`` in its Hugging Face folder."""
    return f"{CARRIED_PART}.{name}"


def is_carried(key: str) -> bool:
    return key.startswith(CARRIED_PART + ".")


def carried_infos(entries: dict[str, Any], where: str) -> list[TensorInfo]:
    """The carried tensors among a DCP folder's entries, under their Hugging Face names."""
    return [TensorInfo(key[len(CARRIED_PART) + 1:], tuple(entry.size), entry.properties.dtype, key, where)
            for key, entry in entries.items() if is_carried(key) and isinstance(entry, TensorStorageMetadata)]


class _StreamingSavePlanner(DefaultSavePlanner):
    """Plans from placeholder tensors; produces each real tensor only when DCP writes it."""

    def __init__(self, fetch) -> None:
        super().__init__()
        self._fetch = fetch

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self._fetch(write_item.index.fqn)


def save_streaming(
    folder: Path,
    source: Source,
    *,
    dtype: torch.dtype | None,
    progress: Progress,
    stored_name: Callable[[str], str] | None = None,
    carry: bool = False,
) -> tuple[list[torch.dtype], dict[str, str]]:
    """Write every tensor of `source` into a DCP folder, under ``stored_name(canonical name)``
    (default: the canonical name), producing each tensor only when DCP writes it; and with ``carry``,
    its carried tensors (``Source.carried``) as they are, under ``carried_key``.
    Returns the dtypes of the model's tensors written and the checksums of the data files."""
    rename = stored_name or (lambda name: name)
    canonical = {rename(info.name): info.name for info in source.infos}
    placeholders = {
        rename(info.name): torch.empty(info.shape, dtype=written_dtype(info.dtype, dtype), device="meta")
        for info in source.infos
    }
    model_dtypes = [p.dtype for p in placeholders.values()]
    carried = {carried_key(info.name): info for info in (source.carried if carry else ())}
    placeholders.update((key, torch.empty(info.shape, dtype=info.dtype, device="meta"))
                        for key, info in carried.items())

    def fetch(key: str) -> torch.Tensor:
        if key in carried:
            tensor = source.load_carried(carried[key].name).contiguous()
        else:
            tensor = cast(source.load(canonical[key]), dtype).contiguous()
        progress(key, tensor.nbytes)
        return tensor

    # One file per tensor: DCP keeps every tensor of a file alive until the file is closed.
    writer = ChecksumWriter(str(folder), single_file_per_rank=False, thread_count=1)
    try:
        with quiet_dcp():
            dcp.save(placeholders, storage_writer=writer, planner=_StreamingSavePlanner(fetch), no_dist=True)
    except CheckpointException as e:  # a BaseException: re-raise what went wrong underneath
        cause = first_failure(e)
        if isinstance(cause, Exception):
            raise cause from None
        raise RuntimeError(f"DCP save to {folder} failed: {one_line(cause)}") from e
    return model_dtypes, writer.checksums


def write(
    folder: Path,
    args: ModelArgs,
    source: Source,
    *,
    dtype: torch.dtype | None,
    progress: Progress,
    step: int = 0,
    extra: dict[str, Any] | None = None,
) -> None:
    written, checksums = save_streaming(folder, source, dtype=dtype, progress=progress, carry=True)
    dtypes = sorted({dtype_name(d) for d in written if d.is_floating_point})  # the weights' (not a hash table's)
    write_metadata(
        folder,
        args,
        step=step,
        weights_only=True,
        dtype=dtypes[0] if len(dtypes) == 1 else "mixed",
        checksums=record({**checksums, **digest_files(folder, [DCP_INDEX])}),
        **(extra or {}),
    )

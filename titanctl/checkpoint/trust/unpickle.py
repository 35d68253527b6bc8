"""The only pickles titanctl reads from a checkpoint, each through an allow-list.

A pickle can name any importable callable and call it while it loads: unpickling a file
someone shared runs their code. torch's DCP reader unpickles ``.metadata`` with plain
``pickle.load`` and non-tensor items with ``torch.load(weights_only=False)``; titanctl
reads both itself, through ``pickle.Unpickler`` subclasses whose ``find_class`` answers
only for the names listed here (taken from the ``.metadata`` files titanctl writes under
every layout: one process, FSDP, TP, PP, DDP, async, weights-only, converted) and refuses
anything else with one line naming the file and the global, e.g.
``.../step-4/.metadata: refusing to unpickle posix.system (not a DCP metadata class)``.

- ``.metadata`` (:func:`load_dcp_index`): DCP's metadata dataclasses and its memory-format
  enum, the file-system reader's ``_StorageInfo``, ``torch.Size``, torch dtypes and layouts
  (by name), and the writer's folder path, rebuilt as a *pure* path (no file access is
  possible through it). The result is then checked field by field (:func:`check_index`).
- non-tensor items (:func:`load_plain_item`, e.g. ``train_state``, the LR schedule): a
  ``torch.save`` archive whose pickle may hold only plain data (dicts, lists, tuples,
  strings, numbers, None, and sets/OrderedDicts/bytes), never a tensor or an object.

Sizes are checked before a byte is read (:data:`MAX_INDEX_BYTES`, :data:`MAX_PLAIN_ITEM_BYTES`,
and a tensor chunk may store no more than its declared size needs), and every pickle's opcodes
are scanned before it is unpickled (``titanctl.safe_io.check_pickle``: nesting at most
``safe_io.MAX_NESTING`` levels, a bounded count of values): CPython's unpickler hashes a nested
key recursively in C, and a 10^6-deep one kills the interpreter with SIGSEGV.
"""

from __future__ import annotations

import functools
import io
import math
import pathlib
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata

from titanctl import _torch_compat
from titanctl.errors import CheckpointCorrupt, CheckpointError
from titanctl.safe_io import check_pickle, read_bytes, regular_file_size

# A non-tensor item is a few KB (the streaming loader's token buffer is the largest); this
# bounds the item as stored and what a crafted compressed archive member can grow into.
MAX_PLAIN_ITEM_BYTES = 256 * 2**20
# DCP's index of a 405B model sharded over 512 ranks is a few hundred MB; 1 GiB leaves room.
MAX_INDEX_BYTES = 2**30
# What torch.save adds around a tensor's bytes (zip headers, data.pkl, alignment): ~1.6 KB measured.
ARCHIVE_OVERHEAD_BYTES = 64 * 2**10


def _dcp_class(module, name: str) -> type:
    """A class of torch's DCP by name; these names are what ``.metadata`` files contain."""
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise RuntimeError(f"torch {torch.__version__} has no {module.__name__}.{name}: update {__name__}")
    return cls


_METADATA_CLASSES = ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
                     "ChunkStorageMetadata", "TensorProperties")
_PRIVATE_METADATA_CLASSES = (_torch_compat.DCP_MEM_FORMAT_ENCODING, _torch_compat.DCP_STORAGE_INFO)
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name: str) -> torch.layout:
    """What ``torch.serialization._get_layout`` does for TensorProperties, for known names only."""
    if name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return _LAYOUTS[name]


@functools.cache
def _metadata_globals() -> dict[tuple[str, str], Any]:
    """What a DCP ``.metadata`` pickle may name (looked up on first use, not at import)."""
    allowed: dict[tuple[str, str], Any] = {
        (dcp_metadata.__name__, name): _dcp_class(dcp_metadata, name) for name in _METADATA_CLASSES
    }
    for entry in _PRIVATE_METADATA_CLASSES:
        module, name = entry.path.rsplit(".", 1)
        allowed[(module, name)] = entry.get()
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = _layout
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    # StorageMeta.checkpoint_id: the writer's folder, a PosixPath (pathlib._local.PosixPath when
    # written by Python 3.13+). Rebuilt as a pure path, which cannot open files.
    for module in ("pathlib", "pathlib._local"):
        allowed[(module, "PosixPath")] = pathlib.PurePosixPath
    return allowed


def _latin1_bytes(text: str, encoding: str) -> bytes:
    """How protocol-2 pickles spell a bytes object: ``_codecs.encode(text, 'latin1')``."""
    if encoding != "latin1" or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


_PLAIN_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("__builtin__", "set"): set,  # protocol 2 (torch.save's) spells builtins the Python 2 way
    ("__builtin__", "frozenset"): frozenset,
    ("_codecs", "encode"): _latin1_bytes,
}


class Refused(pickle.UnpicklingError):
    """A global or object outside the allow-list (an attack or a foreign file: never a corruption)."""


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any], kind: str) -> None:
        super().__init__(io.BytesIO(data))
        self.allowed, self.kind = allowed, kind

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            raise Refused(f"refusing to unpickle {module}.{name} ({self.kind})")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise Refused(f"refusing to unpickle a persistent object {_short(pid)} ({self.kind})")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _unpickle(data: bytes, allowed: dict[tuple[str, str], Any], refusal: str, where: str, what: str) -> Any:
    """Unpickle with `allowed` globals only: CheckpointError when refused, CheckpointCorrupt when
    the bytes are not a pickle at all."""
    check_pickle(data, what=where, error=CheckpointError)  # before the C unpickler can recurse on it
    try:
        return _AllowListUnpickler(data, allowed, refusal).load()
    except Refused as e:
        raise CheckpointError(f"{where}: {e}") from None
    except RecursionError:
        raise CheckpointError(f"{where}: refusing to unpickle a structure nested too deeply") from None
    except Exception as e:  # damaged bytes surface as any of a dozen exception types
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointCorrupt(f"{where} is not a readable {what} ({type(e).__name__}: {first})") from None


# ----------------------------------------------------------------------------- .metadata


def load_dcp_index(path: Path) -> dcp_metadata.Metadata:
    """DCP's ``.metadata`` of a folder, read through the allow-list and checked (:func:`check_index`)."""
    data = read_bytes(Path(path), what="DCP index", max_bytes=MAX_INDEX_BYTES, error=CheckpointError)
    index = _unpickle(data, _metadata_globals(), "not a DCP metadata class", str(path), "DCP index")
    check_index(index, path)
    return index


def check_index_size(path: Path) -> None:
    """A ``.metadata`` larger than MAX_INDEX_BYTES is refused before it is hashed or read."""
    size = regular_file_size(Path(path), what="DCP index", error=CheckpointError)
    if size > MAX_INDEX_BYTES:
        raise CheckpointError(f"DCP index {path} has {size:,} bytes; at most {MAX_INDEX_BYTES:,} are read")


def check_index(index: Any, path: Path) -> None:
    """Every field of a DCP index has the type DCP gives it, and every tensor's declared size is
    covered by chunks whose stored bytes can hold them: a crafted index cannot declare a tensor
    larger than the data on disk (which the caller checks the files hold)."""
    Metadata = _metadata_globals()[(dcp_metadata.__name__, "Metadata")]
    if not isinstance(index, Metadata):
        raise CheckpointError(f"{path} is not a DCP index (it holds a {type(index).__name__})")
    entries, storage = index.state_dict_metadata, index.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"{path} is not a file-system DCP index")
    storage_info = _torch_compat.DCP_STORAGE_INFO.get()
    metadata_index = _metadata_globals()[(dcp_metadata.__name__, "MetadataIndex")]
    for key, info in storage.items():
        if not isinstance(key, metadata_index) or not isinstance(key.fqn, str) or key.fqn not in entries:
            raise CheckpointError(f"{path}: storage entry {_short(key)} belongs to no item of the index")
        if not (isinstance(info, storage_info) and isinstance(info.relative_path, str)
                and _count(info.offset) and _count(info.length)):
            raise CheckpointError(f"{path}: storage entry of {key.fqn!r} is not a (file, offset, length)")
        if info.transform_descriptors:
            raise CheckpointError(
                f"{path}: {key.fqn!r} is stored with transforms {list(info.transform_descriptors)!r}, "
                "which titanctl does not read"
            )
    tensor_meta = _metadata_globals()[(dcp_metadata.__name__, "TensorStorageMetadata")]
    bytes_meta = _metadata_globals()[(dcp_metadata.__name__, "BytesStorageMetadata")]
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise CheckpointError(f"{path}: item name {_short(fqn)} is not a string")
        if isinstance(entry, bytes_meta):
            info = storage.get(metadata_index(fqn))
            if info is None:
                raise CheckpointError(f"{path}: item {fqn!r} has no stored bytes")
            if info.length > MAX_PLAIN_ITEM_BYTES + ARCHIVE_OVERHEAD_BYTES:  # refused before it is read
                raise CheckpointError(
                    f"{path}: non-tensor item {fqn!r} stores {info.length:,} bytes; at most "
                    f"{MAX_PLAIN_ITEM_BYTES + ARCHIVE_OVERHEAD_BYTES:,} are read"
                )
            continue
        if not isinstance(entry, tensor_meta):
            raise CheckpointError(f"{path}: item {fqn!r} is a {type(entry).__name__}, not a DCP tensor or bytes entry")
        _check_tensor_entry(path, fqn, entry, storage, metadata_index)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _dims(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(_count(v) for v in value)


def _check_tensor_entry(path: Path, fqn: str, entry: Any, storage: dict, metadata_index: type) -> None:
    props = entry.properties
    if not (_dims(entry.size) and isinstance(entry.chunks, list)
            and isinstance(getattr(props, "dtype", None), torch.dtype)):
        raise CheckpointError(f"{path}: tensor {fqn!r} has a malformed size, dtype or chunk list")
    itemsize = props.dtype.itemsize
    covered = 0
    for chunk in entry.chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not (_dims(offsets) and _dims(sizes) and len(offsets) == len(sizes) == len(entry.size)) or any(
            o + s > d for o, s, d in zip(offsets, sizes, entry.size)
        ):
            raise CheckpointError(f"{path}: a chunk of tensor {fqn!r} lies outside its size {tuple(entry.size)}")
        info = storage.get(metadata_index(fqn, offsets))
        numel = math.prod(sizes)
        if info is None or info.length < numel * itemsize:
            raise CheckpointError(
                f"{path}: the chunk of tensor {fqn!r} at {tuple(offsets)} has fewer stored bytes than its "
                f"size {tuple(sizes)} needs"
            )
        if info.length > numel * itemsize + ARCHIVE_OVERHEAD_BYTES:  # DCP reads a chunk's bytes whole
            raise CheckpointError(
                f"{path}: the chunk of tensor {fqn!r} at {tuple(offsets)} stores {info.length:,} bytes, more than "
                f"its size {tuple(sizes)} needs ({numel * itemsize:,} + {ARCHIVE_OVERHEAD_BYTES:,} of archive)"
            )
        covered += numel
    if covered != math.prod(entry.size):
        raise CheckpointError(
            f"{path}: the chunks of tensor {fqn!r} cover {covered} elements, its size {tuple(entry.size)} has "
            f"{math.prod(entry.size)}"
        )


# ----------------------------------------------------------------------------- non-tensor items


def load_plain_item(data: bytes, where: str) -> Any:
    """A non-tensor item DCP stored with ``torch.save`` (a zip archive): its plain-data pickle."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        pickles = [info for info in archive.infolist() if info.filename.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise ValueError("no single data.pkl inside")
        if pickles[0].file_size > MAX_PLAIN_ITEM_BYTES:
            raise ValueError(f"data.pkl declares {pickles[0].file_size} bytes")
        with archive.open(pickles[0]) as member:
            payload = member.read(MAX_PLAIN_ITEM_BYTES + 1)
        if len(payload) > MAX_PLAIN_ITEM_BYTES:
            raise ValueError(f"data.pkl is larger than {MAX_PLAIN_ITEM_BYTES} bytes")
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, RuntimeError) as e:
        raise CheckpointCorrupt(f"{where} is not a torch.save archive ({type(e).__name__}: {e})") from None
    return _unpickle(payload, _PLAIN_GLOBALS, "not plain data", where, "plain-data pickle")

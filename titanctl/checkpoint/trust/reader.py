"""titanctl's one way to read a DCP folder: training resume, conversion and generation all use it.

``DCPFolder(folder)`` opens a folder and checks everything that needs no tensor data:

1. ``titanctl.json`` (when present) is read and its fields type-checked;
2. ``.metadata`` is compared with its recorded checksum, then unpickled through an allow-list
   of DCP's metadata classes (``titanctl.checkpoint.trust.unpickle``) and checked field by field;
3. every data file the index names resolves inside the folder (``titanctl.checkpoint.trust.paths``),
   exists, and is long enough for the byte ranges the index gives it.

``verify()`` then hashes the data files against ``titanctl.json``'s checksums (shared over the
ranks of a process group), and ``load(state)`` hands DCP a reader that returns the index
already read (DCP's own would ``pickle.load`` it again) and a planner whose non-tensor items
are read as plain data (DCP's own calls ``torch.load(weights_only=False)`` on them).
Tensors themselves are read by DCP with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta, TensorStorageMetadata

from titanctl.checkpoint.trust import checksums
from titanctl.checkpoint.trust.metadata import METADATA_FILE, RUN_CONFIG, read_metadata
from titanctl.checkpoint.trust.paths import inside
from titanctl.checkpoint.trust.unpickle import check_index_size, load_dcp_index, load_plain_item
from titanctl.errors import CheckpointCorrupt, CheckpointError, TitanError

DCP_INDEX = ".metadata"
# Files of a step folder that are not DCP data: verified when opening, not by verify().
_SMALL_FILES = (DCP_INDEX, RUN_CONFIG)


class DCPFolder:
    """A DCP folder opened for reading (see the module docstring). Raises one-line CheckpointErrors;
    CheckpointCorrupt when bytes are damaged (a checksum mismatch, a truncated or missing file)."""

    def __init__(self, folder: Path, *, require_titanctl: bool = True) -> None:
        self.folder = folder = Path(folder)
        _check_readable(folder)
        self.meta: dict[str, Any] | None = None
        if require_titanctl or (folder / METADATA_FILE).is_file():
            self.meta = read_metadata(folder)
        self.checksums = checksums.recorded(self.meta, folder / METADATA_FILE)
        checksums.require_manifest(self.meta, folder / METADATA_FILE)
        index_file = folder / DCP_INDEX
        if not index_file.is_file():
            raise CheckpointCorrupt(f"{index_file} is missing: {folder} is incomplete or not a DCP checkpoint")
        check_index_size(index_file)  # before it is hashed or read
        if self.checksums is not None:
            checksums.require_listed(folder, self.checksums, [DCP_INDEX])
            present = [name for name in _SMALL_FILES if name in self.checksums]
            checksums.verify(folder, self.checksums, present)  # before a byte of .metadata is unpickled
        self.index = load_dcp_index(index_file)
        self._check_data_files()

    @property
    def entries(self) -> dict[str, Any]:
        """{item name: DCP storage metadata} (tensors: TensorStorageMetadata with size and dtype)."""
        return self.index.state_dict_metadata

    @property
    def verified(self) -> bool:
        """Whether the folder records checksums (and so verify() checks the data)."""
        return self.checksums is not None

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every tensor item, as stored."""
        for name, entry in self.entries.items():
            if isinstance(entry, TensorStorageMetadata):
                yield name, tuple(entry.size)

    def _check_data_files(self) -> None:
        needed: dict[str, int] = {}
        for info in self.index.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(needed.items()):
            data = inside(self.folder, name, str(self.folder / DCP_INDEX))
            try:
                if not data.is_file():
                    raise CheckpointCorrupt(f"{data} is missing (the checkpoint's {DCP_INDEX} refers to it)")
                size = data.stat().st_size
            except OSError as e:
                raise CheckpointError(f"cannot read {data}: {e.strerror or e}") from None
            if size < end:
                raise CheckpointCorrupt(
                    f"{data} is truncated: {size} bytes, but the checkpoint's {DCP_INDEX} needs {end}"
                )
        if self.checksums is not None:
            checksums.require_listed(self.folder, self.checksums, list(needed))

    def verify(self, group=None) -> None:
        """Before any tensor is used: hash the data files against the recorded checksums (when
        recorded; with `group` each rank hashes a share and every rank raises the same error),
        then read every non-tensor item as plain data, also those the caller will not load: a
        checkpoint that carries a pickled object anywhere is refused as a whole."""
        if self.checksums is not None:
            names = [name for name in self.checksums if name not in _SMALL_FILES]
            checksums.verify(self.folder, self.checksums, names, group)
        self._check_items()

    def _check_items(self) -> None:
        by_file: dict[str, list[tuple[int, int, str]]] = {}
        for key, info in self.index.storage_data.items():
            if isinstance(self.entries[key.fqn], BytesStorageMetadata):
                by_file.setdefault(info.relative_path, []).append((info.offset, info.length, key.fqn))
        for name, items in sorted(by_file.items()):
            path = self.folder / name
            try:
                with open(path, "rb") as f:
                    for offset, length, fqn in sorted(items):
                        f.seek(offset)
                        load_plain_item(f.read(length), f"{path} (item {fqn!r})")
            except OSError as e:
                raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None

    def load(
        self,
        state: dict[str, Any],
        *,
        process_group=None,
        no_dist: bool = True,
        on_missing: Callable[[str], TitanError] | None = None,
        unread: frozenset[str] = frozenset(),
    ) -> None:
        """DCP-load `state` in place (Stateful values included) through titanctl's reader and planner.

        `on_missing(key)` makes the error for an item of `state` that the checkpoint lacks; the items of
        `unread` (flattened keys) are not read and keep their values.
        """
        try:
            with quiet_dcp():
                dcp.load(
                    state,
                    storage_reader=_IndexedReader(self),
                    planner=_PlainDataPlanner(self, on_missing, unread),
                    process_group=process_group,
                    no_dist=no_dist,
                )
        except CheckpointException as e:  # a BaseException: DCP's wrapper of every rank's failure
            cause = first_failure(e)
            if isinstance(cause, (TitanError, KeyboardInterrupt)):  # Ctrl-C is an interruption, not a bad file
                raise cause from None
            raise CheckpointError(f"{self.folder}: reading the checkpoint failed: {one_line(cause)}") from None
        except TitanError:
            raise
        except Exception as e:
            raise CheckpointError(f"{self.folder}: reading the checkpoint failed: {one_line(e)}") from None


class _IndexedReader(FileSystemReader):
    """DCP's file-system reader, but ``read_metadata`` returns the index DCPFolder already read safely."""

    def __init__(self, source: DCPFolder) -> None:
        super().__init__(str(source.folder))
        self._index = source.index

    def read_metadata(self, *args: Any, **kwargs: Any):
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path}: per-rank DCP metadata files are not read by titanctl")
        if getattr(self._index, "storage_meta", None) is None:
            self._index.storage_meta = StorageMeta()
        self._index.storage_meta.load_id = self.load_id
        return self._index


class _PlainDataPlanner(DefaultLoadPlanner):
    """DCP's default planner, with two changes: a missing item is a one-line error, and non-tensor
    items are unpickled as plain data only (``titanctl.checkpoint.trust.unpickle.load_plain_item``)."""

    def __init__(self, source: DCPFolder, on_missing: Callable[[str], TitanError] | None,
                 unread: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self._source = source
        self._on_missing = on_missing
        self._unread = unread

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for key in self._unread:
            self.state_dict.pop(key, None)
        for key in self.state_dict:  # flattened, as DCP stores them
            if key not in self._source.entries:
                if self._on_missing is not None:
                    raise self._on_missing(key)
                raise CheckpointError(f"{self._source.folder}: the checkpoint has no item {key!r}")

    def load_bytes(self, read_item, value) -> None:
        info = self._source.index.storage_data[read_item.storage_index]
        where = f"{self._source.folder / info.relative_path} (item {read_item.dest_index.fqn!r})"
        loaded = load_plain_item(value.getvalue(), where)
        fqn = read_item.dest_index.fqn
        if not self.flatten_state_dict:
            self.state_dict[fqn] = loaded
            return
        # Where DCP's flattening found the item in the caller's nested state dict: put it back there.
        *parents, last = self.mappings[fqn]
        node = self.original_state_dict
        for key in parents:
            node = node[key]
        node[last] = loaded


def _check_readable(folder: Path) -> None:
    try:
        if not folder.is_dir():
            raise CheckpointError(f"checkpoint {folder} does not exist or is not a folder")
        next(folder.iterdir(), None)
    except PermissionError:
        raise CheckpointError(f"cannot read checkpoint folder {folder}: permission denied") from None
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint folder {folder}: {e.strerror or e}") from None


def first_failure(e: CheckpointException) -> BaseException:
    """The first underlying exception DCP wrapped (its own message is a multi-line traceback)."""
    for failure in getattr(e, "failures", {}).values():
        return failure[0] if isinstance(failure, tuple) else failure
    return e


def one_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0].rstrip(",:;") if text else ""
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    """DCP warns that it runs without a process group, or into an existing folder: both intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint.*")
        yield

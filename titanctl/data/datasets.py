"""Dataset registry: a name (and maybe a path) -> a source of document strings.

Names:
  bundled      the shipped public-domain corpus (Shakespeare + King James Bible), train split
  bundled_val  its held-out split (2 plays + 3 books)
  c4           allenai/c4 "en" train split, streamed from the Hugging Face hub
  hf:<id>      any Hugging Face dataset, streamed: a hub id (hf:allenai/c4) or a local folder laid
               out like a hub dataset repo (hf:/data/mycorpus, e.g. data/train-00000-of-00002.jsonl),
               with a config, a split (default train) and a text field (default "text")
  local        your files: `path` is a file or a folder searched recursively for
               *.jsonl, *.jsonl.gz, *.json (one {"text": ...} object per line, or one JSON
               list of such objects or of strings), *.parquet (a "text" column) and *.txt
               (each file is one document). Files are read in sorted path order.
               Giving a path with the default name `bundled` also selects `local`.

Finite sources (bundled, bundled_val, local) are read completely and support
layout-invariant, resumable shuffling (see dataloader.py). c4 and hf: datasets stream: they are
only ever read forward (see streaming.py). The `datasets` library is imported only for them.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from titanctl.data import local_files
from titanctl.errors import DataError
from titanctl.safe_io import open_regular, visible

CORPUS_DIR = Path(__file__).resolve().parent.parent / "assets" / "corpus"
TEXT_FIELD = "text"
LOCAL_SUFFIXES = (".jsonl.gz", ".jsonl", ".json", ".parquet", ".txt")


class DocumentSource(ABC):
    """An iterable of document strings plus what the loader needs to know about it."""

    name: str  # registry name, e.g. "bundled"
    description: str  # for messages: a path or a hub id
    streaming: bool  # True: read forward only (c4); False: finite, re-readable
    fingerprint: str  # identifies the content; resumed data state must match it

    @abstractmethod
    def __iter__(self) -> Iterator[str]:
        """Yield the documents, in a fixed order for finite sources."""

    def __repr__(self) -> str:
        kind = "streaming" if self.streaming else "finite"
        return f"{type(self).__name__}({self.name!r}, {self.description!r}, {kind})"


class FileDocumentSource(DocumentSource):
    """Documents read from local files, in the given order. Finite."""

    streaming = False

    def __init__(self, name: str, files: list[Path], description: str) -> None:
        self.name = name
        self.files = files
        self.description = description
        self.fingerprint = local_files.fingerprint(files)

    def __iter__(self) -> Iterator[str]:
        for path in self.files:
            yield from _reader_for(path)(path)


class HFStreamingSource(DocumentSource):
    """A Hugging Face `IterableDataset` read forward; the loader shards it by DP rank."""

    streaming = True

    def __init__(self, name: str, dataset: Any, description: str, text_field: str = TEXT_FIELD) -> None:
        self.name = name
        self.dataset = dataset  # datasets.IterableDataset
        self.description = description
        self.text_field = text_field
        self.num_shards = max(1, int(getattr(dataset, "num_shards", 1) or 1))  # its files, for virtual shards
        # The stream's identity is its origin; its position lives in the loader state.
        self.fingerprint = hashlib.sha256(f"{name}:{description}:{text_field}".encode()).hexdigest()

    def __iter__(self) -> Iterator[str]:
        for row in self.dataset:
            yield self.text_of(row)

    def text_of(self, row: dict) -> str | None:
        if self.text_field not in row:
            raise DataError(
                f"streaming dataset {self.description} has no {self.text_field!r} column "
                f"(columns: {', '.join(map(str, row))}); set text_field"
            )
        text = row[self.text_field]
        if text is not None and not isinstance(text, str):  # a damaged row: refused, as local files' are
            raise DataError(
                f"streaming dataset {self.description}: a row's {self.text_field!r} is "
                f"{type(text).__name__} {visible(repr(text)[:80])}, not text"
            )
        return text


def load_documents(
    name: str = "bundled", path: str | None = None, *, config: str = "", split: str = "train",
    text_field: str = TEXT_FIELD,
) -> DocumentSource:
    """Resolve a dataset name (and, for `local`, a path) to a DocumentSource.

    A path implies `local` (training.dataset_path alone is enough): with the default name
    "bundled" it selects the path's files. With bundled_val or c4 a path is a contradiction.
    ``config``, ``split`` and ``text_field`` are for ``hf:`` names only.
    """
    if name.startswith("hf:"):
        if path:
            raise DataError(f"dataset {name!r} takes no path (got {path!r}); the folder goes after hf:")
        return _hf(name, config, split, text_field)
    if name not in _REGISTRY:
        raise DataError(
            f"unknown dataset {name!r}{_suggest(name)}; valid names: {', '.join(_REGISTRY)}, hf:<hub id or folder>"
        )
    if name == "local" or (name == "bundled" and path):
        if not path:
            raise DataError("dataset 'local' needs training.dataset_path=FILE_OR_FOLDER")
        return _local(path)
    if path:
        raise DataError(
            f"dataset {name!r} takes no path (got {path!r}); "
            "unset training.dataset_path, or use training.dataset=local to read it"
        )
    return _REGISTRY[name]()


def _bundled(split: str) -> Callable[[], DocumentSource]:
    def build() -> DocumentSource:
        file = CORPUS_DIR / f"{split}.jsonl.gz"
        if not file.is_file():
            raise DataError(
                f"bundled corpus file {file} is missing; regenerate it with scripts/build_corpus.py"
            )
        return FileDocumentSource(f"bundled_{split}" if split != "train" else "bundled", [file], str(file))

    return build


def _local(path: str) -> DocumentSource:
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(
            f"dataset path {path!r} does not exist; "
            f"give a {'/'.join(LOCAL_SUFFIXES)} file or a folder of them"
        )
    if not root.is_dir():  # a file, or something that is not one (refused when read)
        if _suffix(root) is None:
            raise DataError(
                f"dataset file {path!r} has an unsupported type; expected one of {', '.join(LOCAL_SUFFIXES)}"
            )
        files = [root]
    else:
        files = sorted(
            p
            for p in root.rglob("*")
            if p.is_file()
            and _suffix(p) is not None
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
        )
        if not files:
            raise DataError(f"dataset folder {path!r} holds no {', '.join(LOCAL_SUFFIXES)} files")
    return FileDocumentSource("local", files, str(root))


def _c4() -> DocumentSource:
    return _stream("c4", "allenai/c4", "en", "train", TEXT_FIELD,
                   hint="use training.dataset=bundled or training.dataset_path=FILE")


def _hf(name: str, config: str, split: str, text_field: str) -> DocumentSource:
    """hf:<hub id or local folder>: the folder is read offline; a hub id needs the hub."""
    target = name[len("hf:"):]
    if not target:
        raise DataError("dataset 'hf:' names nothing; give hf:<hub id> (hf:allenai/c4) or hf:<local folder>")
    folder = Path(target).expanduser()
    if folder.is_dir():
        return _stream(name, str(folder), config, split, text_field, hint="check the folder's files", hub=False)
    if target.startswith((".", "/", "~")) or target.count("/") > 1:  # a path, not owner/name
        raise DataError(f"dataset {name!r}: folder {target!r} does not exist (a hub id looks like owner/name)")
    return _stream(name, target, config, split, text_field,
                   hint="use a local folder (hf:/path/to/folder), training.dataset=bundled or a dataset_path")


def _stream(
    name: str, target: str, config: str, split: str, text_field: str, *, hint: str, hub: bool = True
) -> DocumentSource:
    """A streaming `datasets.IterableDataset` of a hub id (or a local folder, hub=False)."""
    where = "from the Hugging Face hub (offline or unreachable)" if hub else "as a streaming dataset"
    reason = _hub_unreachable() if hub else None
    if reason:  # fail in a moment instead of after datasets' ~20 s of retries
        raise DataError(f"cannot load {target} {where}: {reason}; {hint}")
    import datasets  # only hub datasets load it (and pyarrow): bundled and local files stay light

    from titanctl.data.hf_folder import check_files, check_text_column

    try:
        # load_dataset(..., streaming=True) in two steps: a local folder's files are checked
        # between them, before datasets reads any of them.
        builder = datasets.load_dataset_builder(target, name=config or None)
        if not hub:
            check_files(Path(target), builder, split, text_field)
        dataset = builder.as_streaming_dataset(split=split)
    except DataError:
        raise
    except Exception as e:  # ConnectionError, hub HTTP errors, missing cache when offline, bad split
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"cannot load {target} {where}: {visible(first)}; {hint}") from None
    description = f"{target}:{config}:{split}"
    check_text_column(getattr(dataset, "features", None), text_field, visible(description))
    return HFStreamingSource(name, dataset, description, text_field)


def _hub_unreachable(timeout_s: float = 2.0) -> str | None:
    """Why the hub cannot be reached (offline mode or no connection), or None."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return f"{var}={os.environ[var]}"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # only the proxy knows whether the hub is reachable: let `datasets` try
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = (
        endpoint.hostname or "huggingface.co",
        endpoint.port or (80 if endpoint.scheme == "http" else 443),
    )
    result: list[str] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            result.append("")
        except OSError as e:
            result.append(f"{host}:{port}: {e.strerror or e}")

    # DNS lookups ignore socket timeouts, so the probe runs in a thread we stop waiting for.
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:
        return f"no answer from {host}:{port} within {timeout_s:.0f} s"
    return result[0] or None


_REGISTRY: dict[str, Callable[[], DocumentSource] | None] = {
    "bundled": _bundled("train"),
    "bundled_val": _bundled("val"),
    "c4": _c4,
    "local": None,  # needs a path: handled in load_documents
}


def _suggest(name: str) -> str:
    close = difflib.get_close_matches(name.lower(), list(_REGISTRY), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---- local file readers -------------------------------------------------------------


def _suffix(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in LOCAL_SUFFIXES if name.endswith(s)), None)


def _reader_for(path: Path) -> Callable[[Path], Iterator[str]]:
    return {
        ".jsonl.gz": _read_jsonl,
        ".jsonl": _read_jsonl,
        ".json": _read_json,
        ".parquet": _read_parquet,
        ".txt": _read_txt,
    }[_suffix(path)]


def _text_of(record: Any, where: str) -> str:
    if isinstance(record, str):
        return record
    if isinstance(record, dict) and isinstance(record.get(TEXT_FIELD), str):
        return record[TEXT_FIELD]
    raise DataError(
        f"{where}: expected an object with a string {TEXT_FIELD!r} field, got {str(record)[:80]!r}"
    )


def _read_jsonl(path: Path) -> Iterator[str]:
    where = visible(str(path))
    for n, line in local_files.lines(path):
        if isinstance(line, local_files.TooLong):
            raise DataError(f"{where}:{n}: a line {line.reason}; titanctl reads documents of at most that: "
                            "split it")
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}:{n}: not UTF-8 (byte {e.start + 1} of the line)") from None
        yield _text_of(_parse_json(text, f"{where}:{n}"), f"{where}:{n}")


def _read_json(path: Path) -> Iterator[str]:
    """A JSON list of records or strings; a file of JSON lines named .json works too."""
    raw = local_files.whole(path)
    if raw is None:
        if local_files.starts_with(path, b"["):
            raise local_files.too_large(path, "dataset file")
        yield from _read_jsonl(path)
        return
    try:
        whole = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{visible(str(path))} is not UTF-8 (byte {e.start})") from None
    except RecursionError:
        raise DataError(f"{path}: nests too deep to read") from None
    except json.JSONDecodeError:
        yield from _read_jsonl(path)
        return
    records = whole if isinstance(whole, list) else [whole]
    for n, record in enumerate(records):
        yield _text_of(record, f"{path}[{n}]")


def _read_parquet(path: Path) -> Iterator[str]:
    import pyarrow.parquet as pq  # only parquet files need it

    with open_regular(path, what="dataset file", error=DataError) as f:
        try:
            file = pq.ParquetFile(f)
        except Exception as e:  # pyarrow raises its own ArrowInvalid for a non-parquet file
            raise DataError(f"cannot read {path} as parquet: {e}") from None
        local_files.check_parquet_size(file, path, f)
        if TEXT_FIELD not in file.schema_arrow.names:
            raise DataError(f"{path}: no {TEXT_FIELD!r} column (columns: {', '.join(file.schema_arrow.names)})")
        for batch in file.iter_batches(columns=[TEXT_FIELD], batch_size=4096):
            for text in batch.column(0).to_pylist():
                if text is not None:
                    yield text


def _read_txt(path: Path) -> Iterator[str]:
    raw = local_files.whole(path)
    if raw is None:
        raise DataError(f"{visible(str(path))} is one document of more than {local_files.MAX_DOCUMENT_BYTES:,} bytes; "
                        "titanctl reads documents of at most that: split it")
    try:
        yield raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{visible(str(path))} is not UTF-8 (byte {e.start})") from None


def _parse_json(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg})") from None
    except RecursionError:  # Python's parser stops at its recursion limit: safe, but not a document
        raise DataError(f"{where}: nests too deep to read") from None


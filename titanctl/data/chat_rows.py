"""The rows of a chat dataset: which files (``chat:<file, folder or hf:id>``) and what they hold.

- a file: JSON lines (``.jsonl``, ``.jsonl.gz``), a ``.json`` array (or JSON lines under that name),
  or ``.parquet``;
- a folder, or ``hf:<folder>``: laid out like a Hugging Face dataset repository; the split's files
  are the ones the ``datasets`` library would read for it (``data/train-00000-of-00001.parquet``,
  ``train.jsonl``, or every file when no name says a split). A file that resolves outside the
  folder (a link out) is refused;
- ``hf:<owner/name>``: that repository, downloaded from the Hub into its cache, then read as a folder;
- ``bundled``: the small chat set titanctl ships (titanctl/assets/chat, built by
  scripts/build_chat_data.py from the bundled corpus; splits train and validation);
- ``arithmetic``: the task ``titanctl rl`` ships (titanctl/assets/arithmetic, built by
  scripts/build_rl_task.py: which of two two-digit numbers is larger, as prompt and completion; splits
  train and validation).

Rows are yielded with where they came from (``file:line`` or ``file[row]``). A line that is not
valid UTF-8 JSON is yielded as ``Unreadable`` so that the caller counts it; a file that cannot be
opened at all is a one-line DataError.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titanctl.data import local_files
from titanctl.errors import DataError
from titanctl.safe_io import MAX_NESTING, open_regular, visible

CHAT_SUFFIXES = (".jsonl.gz", ".jsonl", ".json", ".parquet")
_ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUNDLED = _ASSETS / "chat"
SHIPPED = {"bundled": BUNDLED, "arithmetic": _ASSETS / "arithmetic"}  # sets titanctl ships, by name
_SKIPPED_SUFFIXES = (".md",)  # a repository's README sits beside its data
# A JSON line longer than this is skipped unread: 8x the longest conversation (chat.MAX_CONVERSATION_CHARS)
# leaves room for JSON's escapes, and parsing it takes at most a few hundred MB.
MAX_ROW_BYTES = 16 << 20


@dataclass(frozen=True)
class Unreadable:
    reason: str


def chat_files(target: str, split: str = "train") -> tuple[list[Path], str]:
    """(the files of ``target``'s ``split``, in order; a description for messages)."""
    if target.startswith("hf:"):
        name = target[len("hf:"):]
        folder = Path(name).expanduser()
        if not name:
            raise DataError("dataset 'chat:hf:' names nothing; give chat:hf:<hub id> or chat:hf:<folder>")
        if not folder.is_dir():
            if name.startswith((".", "/", "~")) or name.count("/") != 1:
                raise DataError(f"chat dataset {visible(target)}: folder {visible(name)} does not exist "
                                "(a hub id looks like owner/name)")
            folder = _download(name)
        return _split_files(folder, split), f"{visible(target)}:{split}"
    if target in SHIPPED:
        return _split_files(SHIPPED[target], split), f"{target}:{split}"
    path = Path(target).expanduser()
    if not target:
        raise DataError("dataset 'chat:' names nothing; give chat:<file, folder or hf:id>")
    if path.is_dir():
        return _split_files(path, split), f"{visible(str(path))}:{split}"
    if not path.exists():
        raise DataError(f"chat dataset {visible(target)} does not exist; give a {'/'.join(CHAT_SUFFIXES)} file, "
                        "a folder laid out like a Hugging Face dataset, or hf:<hub id>")
    if _suffix(path) is None:
        raise DataError(f"chat dataset file {visible(target)} has an unsupported type; "
                        f"expected one of {', '.join(CHAT_SUFFIXES)}")
    return [path], visible(str(path))


def read_rows(files: list[Path]) -> Iterator[tuple[Any, str]]:
    """(row, where) for every row of the files, in order; unreadable rows as ``Unreadable``."""
    for path in files:
        suffix = _suffix(path)
        if suffix == ".parquet":
            yield from _parquet_rows(path)
        elif suffix == ".json":
            yield from _json_rows(path)
        else:
            yield from _jsonl_rows(path)


def _suffix(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in CHAT_SUFFIXES if name.endswith(s)), None)


def _download(repo_id: str) -> Path:
    from titanctl.data.datasets import _hub_unreachable

    reason = _hub_unreachable()
    if reason:
        raise DataError(f"cannot download chat dataset hf:{visible(repo_id)} from the Hugging Face hub (offline or "
                        f"unreachable): {reason}; give a local file or folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=repo_id, repo_type="dataset",
                                      allow_patterns=[f"*{s}" for s in CHAT_SUFFIXES] + ["**/*.md", "*.md"]))
    except Exception as e:  # hub errors: missing repository, gated, network
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"cannot download chat dataset hf:{visible(repo_id)}: {visible(first)}") from None


def _split_files(folder: Path, split: str) -> list[Path]:
    """The files of ``split`` in a folder laid out like a hub dataset repository."""
    from datasets.data_files import DataFilesDict, get_data_patterns  # only folders need its rules

    try:
        patterns = get_data_patterns(str(folder))
        splits = {str(k): list(v) for k, v in DataFilesDict.from_patterns(patterns, base_path=str(folder)).items()}
    except Exception as e:  # datasets' EmptyDatasetError and friends
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"chat dataset folder {visible(str(folder))}: {visible(first)}") from None
    if split not in splits:
        raise DataError(f"chat dataset folder {visible(str(folder))} has no {split!r} split "
                        f"(splits: {', '.join(sorted(splits)) or 'none'})")
    limit = Path(os.path.realpath(folder))
    if limit.parent.name == "snapshots" and (limit.parent.parent / "blobs").is_dir():
        limit = limit.parent.parent  # a hub cache snapshot: its files link into the repository's blobs/
    files = []
    for name in splits[split]:
        path = Path(name)
        if path.name.lower().endswith(_SKIPPED_SUFFIXES):
            continue
        if _suffix(path) is None:
            raise DataError(f"chat dataset file {visible(name)} has an unsupported type; chat data is read from "
                            f"{', '.join(CHAT_SUFFIXES)} files")
        if not Path(os.path.realpath(path)).is_relative_to(limit):
            raise DataError(f"chat dataset file {visible(name)} resolves outside {visible(str(folder))}: refusing it")
        files.append(path)
    if not files:
        raise DataError(f"chat dataset folder {visible(str(folder))}: its {split!r} split holds no "
                        f"{', '.join(CHAT_SUFFIXES)} files")
    return files


def _parse(line: bytes) -> Any:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return Unreadable("not UTF-8")
    try:
        value = json.loads(text)
    except RecursionError:
        return Unreadable("nesting too deep")
    except ValueError:
        return Unreadable("not valid JSON")
    return value if _shallow(value) else Unreadable("nesting too deep")


def _shallow(value: Any) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_NESTING:
            return False
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return True


def _jsonl_rows(path: Path) -> Iterator[tuple[Any, str]]:
    where = visible(str(path))
    for number, line in local_files.lines(path, "chat dataset file", MAX_ROW_BYTES):
        yield (Unreadable(line.reason) if isinstance(line, local_files.TooLong) else _parse(line)), f"{where}:{number}"


def _json_rows(path: Path) -> Iterator[tuple[Any, str]]:
    """A JSON array of rows (one object counts as one row); a file of JSON lines named .json works too."""
    where = visible(str(path))
    data = local_files.whole(path, "chat dataset file")
    if data is None:  # too large to read whole: JSON lines, or refused
        if local_files.starts_with(path, b"[", "chat dataset file"):
            raise local_files.too_large(path, "chat dataset file")
        yield from _jsonl_rows(path)
        return
    whole = _parse(data)
    if isinstance(whole, Unreadable):
        if b"\n" in data.strip():
            yield from _jsonl_rows(path)
        else:
            yield whole, where
        return
    for number, row in enumerate(whole if isinstance(whole, list) else [whole]):
        yield row, f"{where}[{number}]"


def _parquet_rows(path: Path) -> Iterator[tuple[Any, str]]:
    import pyarrow.parquet as pq  # only parquet files need it

    where = visible(str(path))
    with open_regular(path, what="chat dataset file", error=DataError) as f:
        try:
            file = pq.ParquetFile(f)
            local_files.check_parquet_size(file, path, f)
            number = 0
            for batch in file.iter_batches(batch_size=1024):
                for row in batch.to_pylist():
                    yield row, f"{where}[{number}]"
                    number += 1
        except DataError:
            raise
        except Exception as e:  # pyarrow's ArrowInvalid, OSError: not parquet, or damaged
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"cannot read {where} as parquet: {visible(first)}") from None

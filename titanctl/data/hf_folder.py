"""The data files of a local ``hf:`` folder, checked before the ``datasets`` library reads them.

``datasets`` hands a folder's files to readers that trust them (pyarrow, ujson, pandas), and what
goes wrong there goes wrong deep inside it: a JSON line nested 10^5 deep killed training with
SIGSEGV and no output, a 500 MB line took more than 2 GiB (datasets grows its read block until a
line fits), ``train.jsonl`` linking to ``/etc/passwd`` was read, and non-UTF-8 bytes, NUL bytes, a
parquet row group without rows or a parquet ``text`` column of integers ended in tracebacks of
60 lines. So every file of the split is read once here first, as bytes, and the first problem is
one line naming the file (and the line) before any work.

What a file must be:
- a regular file that resolves, links followed, inside the folder (for a snapshot folder of the
  Hugging Face cache, inside its repository, whose ``blobs/`` its links point into);
- JSON lines, CSV and text: lines of at most ``MAX_DOCUMENT_BYTES`` (a JSON file that is one array,
  and a text file read by paragraph or as one document, is read whole: the file counts), UTF-8,
  no NUL byte, JSON nested at most ``MAX_NESTING`` deep; plain or compressed with gzip, bz2 or xz;
- parquet: a footer pyarrow reads (it refuses a schema nested more than 100 levels deep), a
  string ``text`` column, no row group without rows.
Other kinds of files (``datasets`` reads dozens) are refused: titanctl checks only what it reads.

Cost: one pass over the bytes (a parquet file: its footer), in blocks: 130-290 MiB/s of JSON lines
on one core of a busy 2-core machine (the slower with many brackets in the text: a line with more
brackets than the nesting limit is parsed once more).
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import json
import lzma
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from titanctl.data.local_files import MAX_DOCUMENT_BYTES  # a longer line is refused: datasets holds it many times
from titanctl.errors import DataError
from titanctl.safe_io import MAX_NESTING, open_regular, visible

_BLOCK_BYTES = 8 << 20  # read and checked at once
_READ_LINES = frozenset({"json", "csv", "text"})  # datasets' packaged modules titanctl can check
# How datasets tells compression from a file name (its last dotted part, cut at ?, - or _), and,
# for a name it does not know, from the first bytes.
_KNOWN_PLAIN = frozenset({"txt", "csv", "json", "jsonl", "tsv", "parquet"})
_BY_SUFFIX = {"gz": "gzip", "gzip": "gzip", "bz2": "bz2", "xz": "xz", "zst": "zstd", "zstd": "zstd", "lz4": "lz4",
              "zip": "zip", "7z": "7z", "tar": "tar", "tgz": "tar"}
_BY_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bz2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"),
             (b"\x04\x22\x4d\x18", "lz4"), (b"PK\x03\x04", "zip"), (b"PK\x05\x06", "zip"), (b"Rar!", "rar"))
_DECOMPRESS = {"gzip": lambda raw: gzip.GzipFile(fileobj=raw, mode="rb"), "bz2": bz2.BZ2File, "xz": lzma.LZMAFile}
# A JSON string, up to its closing quote or the end of the line; possessive, so never rescanned.
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|$)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def check_files(folder: Path, builder: Any, split: str, text_field: str) -> None:
    """Check every data file that ``builder`` (a ``datasets`` builder of ``folder``) reads for ``split``."""
    files = next((list(v) for k, v in (builder.config.data_files or {}).items() if str(k) == split), None)
    if files is None:
        return  # no such split: datasets says so in its own words
    module = builder.name
    if module not in _READ_LINES and module != "parquet":
        raise DataError(
            f"hf:{visible(str(folder))}: its {split} files are read as {module!r} data; titanctl reads "
            "JSON lines, CSV, text and parquet files from a local folder"
        )
    whole = module == "text" and getattr(builder.config, "sample_by", "line") != "line"
    limit = _boundary(folder)
    for name in files:
        path = _inside(folder, limit, str(name))
        if module == "parquet":
            _check_parquet(path, text_field)
        else:
            with _open(path) as f:
                _check_lines(f, visible(str(path)), json_rows=module == "json", whole=whole)


def _boundary(folder: Path) -> Path:
    """The folder its files must resolve into: a Hugging Face cache snapshot's links point into its
    repository's ``blobs/``, so there the repository is the boundary."""
    real = Path(os.path.realpath(folder))
    repo = real.parent.parent
    if real.parent.name == "snapshots" and repo.name.startswith("datasets--") and (repo / "blobs").is_dir():
        return repo
    return real


def _inside(folder: Path, limit: Path, name: str) -> Path:
    shown = visible(name)
    if "::" in name or "://" in name:
        raise DataError(f"hf:{visible(str(folder))} names data file {shown}, which is not in the folder: refusing it")
    real = Path(os.path.realpath(name))
    if not real.is_relative_to(limit):
        how = "a link to" if os.path.islink(name) or real != Path(os.path.abspath(name)) else "at"
        raise DataError(
            f"data file {shown} is {how} {visible(str(real))}, outside hf:{visible(str(folder))}: refusing to read it"
        )
    return Path(name)


@contextlib.contextmanager
def _open(path: Path) -> Iterator[BinaryIO]:
    """``path`` as ``datasets`` will read it: decompressed as its name (or, for a name it does not
    know, its first bytes) says."""
    with open_regular(path, what="data file", error=DataError) as raw:
        parts = path.name.rsplit(".", 1)
        suffix = re.split(r"[?\-_]", parts[-1])[0].lower() if len(parts) == 2 else ""
        kind = _BY_SUFFIX.get(suffix)
        if kind is None and suffix not in _KNOWN_PLAIN:
            head = raw.read(8)
            raw.seek(0)
            kind = next((k for magic, k in _BY_MAGIC if head.startswith(magic)), None)
        if kind is None:
            yield raw
        elif kind in _DECOMPRESS:
            with _DECOMPRESS[kind](raw) as decompressed:  # closing it leaves ``raw`` to its own ``with``
                yield decompressed
        else:
            raise DataError(f"data file {visible(str(path))} is compressed with {kind}, which titanctl does not "
                            "read: decompress it (or use gzip, bz2 or xz)")


def _check_lines(f: BinaryIO, where: str, *, json_rows: bool, whole: bool) -> None:
    """Lines of at most MAX_DOCUMENT_BYTES, UTF-8, without NUL, JSON shallow enough (``json_rows``);
    with ``whole``, the file too. A JSON file is read whole from a line that starts with ``[``
    (datasets reads on to the end when a 10 MB batch starts so), so with such a line the file counts.

    A block of whole lines is checked at a time, each check one pass over the block in C (bytes
    methods, numpy): a line at a time in Python was 3-5x slower."""
    limit = MAX_DOCUMENT_BYTES
    carry, first_line, total = b"", 1, 0  # the unfinished last line; the number of the block's first line
    try:
        while True:
            block = f.read(_BLOCK_BYTES)
            data = carry + block
            if not data:
                return
            if first_line == 1:
                data = data.removeprefix(b"\xef\xbb\xbf")  # a byte order mark, which datasets drops too
            cut = data.rfind(b"\n") + 1 if block else len(data)  # at the end of the file: the rest
            lines, carry = data[:cut], data[cut:]
            if len(carry) > limit:
                lines, carry = data, b""  # the long line is named below
            total += len(lines)
            whole = _check_block(lines, where, first_line, json_rows=json_rows) or whole
            if whole and total + len(carry) > limit:
                raise DataError(f"{where} has more than {limit:,} bytes and is read whole (a JSON array, or text read "
                                "by paragraph or as one document); write it as lines of one document each")
            first_line += lines.count(b"\n")
    except (OSError, EOFError, lzma.LZMAError) as e:  # a damaged compressed stream, a read error
        raise DataError(f"cannot read {where}: {visible(str(e))}") from None


def _check_block(lines: bytes, where: str, first_line: int, *, json_rows: bool) -> bool:
    """The line checks of ``_check_lines`` on ``lines``, line ``first_line`` and those after it.
    Returns whether a JSON line among them starts an array."""
    if not lines:
        return False
    limit = MAX_DOCUMENT_BYTES
    codes = np.frombuffer(lines, np.uint8)
    starts = np.concatenate(([0], np.flatnonzero(codes == ord("\n")) + 1))  # where each line begins
    if starts[-1] == len(lines):
        starts = starts[:-1]
    ends = np.append(starts[1:], len(lines))
    lengths = ends - starts - (codes[ends - 1] == ord("\n"))
    too_long = np.flatnonzero(lengths > limit)
    if len(too_long):
        raise DataError(f"{where}: line {first_line + int(too_long[0])} has more than {limit:,} bytes; titanctl reads "
                        f"documents of at most {limit:,} bytes: split it")
    nul = lines.find(b"\0")
    if nul >= 0:
        line = first_line + lines.count(b"\n", 0, nul)
        raise DataError(f"{where}: line {line} holds a NUL byte: not text")
    try:
        lines.decode("utf-8")  # the block ends with a line: no character is cut in two
    except UnicodeDecodeError as e:
        line = first_line + lines.count(b"\n", 0, e.start)
        column = e.start - (lines.rfind(b"\n", 0, e.start) + 1)
        raise DataError(f"{where}: line {line} is not UTF-8 (byte {column + 1} of the line)") from None
    if not json_rows:
        return False
    openers = np.flatnonzero((codes == ord("[")) | (codes == ord("{")))
    counts = np.bincount(np.searchsorted(starts, openers, side="right") - 1, minlength=len(starts))
    for index in np.flatnonzero(counts > MAX_NESTING).tolist():  # only these can nest too deep
        if _nests_deeper(lines[int(starts[index]):int(ends[index])], MAX_NESTING):
            raise DataError(f"{where}: line {first_line + index} nests deeper than {MAX_NESTING} levels")
    return bool((codes[starts] == ord("[")).any())


def _nests_deeper(line: bytes, limit: int) -> bool:
    """Whether the JSON value on ``line`` nests deeper than ``limit``. Python's parser is safe (it
    stops at its recursion limit) and fast; for a line it cannot parse, the brackets outside
    strings decide."""
    try:
        value = json.loads(line)
    except RecursionError:
        return True
    except ValueError:
        return _bracket_depth(line, limit) > limit
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _bracket_depth(line: bytes, limit: int) -> int:
    """How deep the brackets outside JSON strings nest (stops counting past ``limit``)."""
    brackets = _JSON_STRING.sub(b"", line).translate(None, _NOT_BRACKETS)
    depth, deepest = 0, 0
    for start in range(0, len(brackets), 1 << 20):  # the running depth, a megabyte of brackets at a time
        steps = np.frombuffer(brackets, np.uint8, count=min(1 << 20, len(brackets) - start), offset=start)
        running = depth + np.cumsum(np.where((steps == ord("[")) | (steps == ord("{")), 1, -1))
        deepest = max(deepest, int(running.max()))
        if deepest > limit:
            break
        depth = int(running[-1])
    return deepest


def _check_parquet(path: Path, text_field: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    where = visible(str(path))
    with open_regular(path, what="data file", error=DataError) as f:
        try:
            file = pq.ParquetFile(f)
        except Exception as e:  # pyarrow's ArrowInvalid and OSError for a file that is no parquet
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"{where} is not a readable parquet file: {visible(first)}") from None
        schema, meta = file.schema_arrow, file.metadata
    if text_field in schema.names:
        kind = schema.field(text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
            raise DataError(f"{where}: column {text_field!r} holds {kind} values, not text")
    for group in range(meta.num_row_groups):
        if meta.row_group(group).num_rows == 0:
            raise DataError(f"{where}: row group {group} holds no rows, which datasets cannot read; "
                            "write the file without it")


def check_text_column(features: Any, text_field: str, description: str) -> None:
    """The stream's declared columns (``datasets.Features``; None when not known before reading)
    hold ``text_field`` as strings; else one line, before any work."""
    if features is None:
        return
    if text_field not in features:
        raise DataError(f"streaming dataset {description} has no {text_field!r} column "
                        f"(columns: {', '.join(map(str, features))}); set text_field")
    dtype = getattr(features[text_field], "dtype", None)
    if dtype not in ("string", "large_string", "string_view"):
        raise DataError(f"streaming dataset {description}: column {text_field!r} holds "
                        f"{dtype or type(features[text_field]).__name__} values, not text")

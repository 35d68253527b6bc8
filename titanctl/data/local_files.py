"""The one way titanctl opens a dataset's local files: pre-training ``local`` data, chat data and
validation data, when it fingerprints them and when it reads them.

- Each file is opened with ``open_regular`` before a byte is read: a FIFO, a device (a link to
  /dev/zero) or a /proc file is a one-line DataError, never a read that blocks or never ends.
- A line (a JSON row, a document) holds at most ``MAX_DOCUMENT_BYTES`` (a chat row: its own
  limit): a longer one is read through in blocks and reported as too long, never held whole.
- A ``.gz`` file inflates to at most ``inflate_limit(size)`` bytes (``MAX_INFLATE_RATIO`` times
  its size, and never less than ``MIN_INFLATE_LIMIT``): a 6 MB file of one 6 GB line is refused
  after reading 600 MB, in seconds and in blocks.
- A parquet row group inflates to at most the same limit (its footer says how much, before reading).
- A file read whole (a ``.json`` array, a ``.txt`` document) holds at most ``MAX_DOCUMENT_BYTES``;
  a larger ``.json`` file of JSON lines is read line by line.
So reading a file of lines holds at most twice its line limit (the pieces of a line, then the line).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from titanctl.errors import DataError
from titanctl.safe_io import open_regular, visible

MAX_DOCUMENT_BYTES = 64 << 20  # the bundled corpus's longest document (a play) has 0.2 MB
MAX_INFLATE_RATIO = 100  # text compresses 3-10x with gzip; a compression bomb 1000x
MIN_INFLATE_LIMIT = 256 << 20  # small files may compress better (repeated rows) and still inflate
_BLOCK_BYTES = 1 << 20


class TooLong:
    """A line longer than the reader's limit (its bytes are not kept)."""

    def __init__(self, limit: int) -> None:
        self.reason = f"longer than {limit:,} bytes"


def compressed(path: Path) -> bool:
    return path.name.lower().endswith(".gz")


def inflate_limit(size: int) -> int:
    """How many bytes a compressed file of ``size`` bytes may inflate to."""
    return max(MIN_INFLATE_LIMIT, MAX_INFLATE_RATIO * size)


def fingerprint(files: list[Path], what: str = "dataset file") -> str:
    """sha256 over the files' names, sizes and bytes, so that a copied dataset keeps its identity."""
    digest = hashlib.sha256()
    for path in files:
        with open_regular(path, what=what, error=DataError) as f:
            try:
                digest.update(f"{path.name}\0{_size(f)}\0".encode())
                while chunk := f.read(_BLOCK_BYTES):
                    digest.update(chunk)
            except OSError as e:
                raise DataError(f"cannot read {what} {visible(str(path))}: {e.strerror or e}") from None
    return digest.hexdigest()


def lines(path: Path, what: str = "dataset file", max_line: int = MAX_DOCUMENT_BYTES,
          ) -> Iterator[tuple[int, bytes | TooLong]]:
    """(line number, the line's bytes without its newline, or ``TooLong`` past ``max_line`` bytes) of
    a file, inflated when its name ends in .gz; blank lines are left out."""
    where = visible(str(path))
    with open_regular(path, what=what, error=DataError) as raw:
        stream: BinaryIO = _Inflating(raw, path) if compressed(path) else raw
        pending: list[bytes] = []  # the pieces of the unfinished line (none while skipping a long one)
        pending_bytes, number, skipping = 0, 1, False
        try:
            while block := stream.read(_BLOCK_BYTES):
                *ended, rest = block.split(b"\n")
                for piece in ended:
                    if skipping or pending_bytes + len(piece) > max_line:
                        yield number, TooLong(max_line)
                    elif pending or piece.strip():
                        line = b"".join([*pending, piece])
                        if line.strip():
                            yield number, line
                    pending, pending_bytes, number, skipping = [], 0, number + 1, False
                if not skipping:
                    pending.append(rest)
                    pending_bytes += len(rest)
                    if pending_bytes > max_line:  # read on to its end, keeping nothing
                        pending, pending_bytes, skipping = [], 0, True
        except (OSError, EOFError, zlib.error) as e:  # a damaged gzip stream, a read error
            raise DataError(f"cannot read {where}: {visible(str(e))}") from None
        line = b"".join(pending)
        if skipping:
            yield number, TooLong(max_line)
        elif line.strip():
            yield number, line


def whole(path: Path, what: str = "dataset file") -> bytes | None:
    """The bytes of a file that is read whole, or None when it holds more than MAX_DOCUMENT_BYTES
    (checked before reading)."""
    with open_regular(path, what=what, error=DataError) as f:
        if _size(f) > MAX_DOCUMENT_BYTES:
            return None
        try:
            data = f.read(MAX_DOCUMENT_BYTES + 1)
        except OSError as e:
            raise DataError(f"cannot read {what} {visible(str(path))}: {e.strerror or e}") from None
        return data if len(data) <= MAX_DOCUMENT_BYTES else None


def starts_with(path: Path, prefix: bytes, what: str = "dataset file") -> bool:
    """Whether the file's first non-blank byte starts ``prefix`` (a JSON array: ``b"["``)."""
    with open_regular(path, what=what, error=DataError) as f:
        return f.read(4096).lstrip().removeprefix(b"\xef\xbb\xbf").lstrip().startswith(prefix)


def check_parquet_size(file, path: Path, f: BinaryIO) -> None:
    """A parquet file (``pyarrow.parquet.ParquetFile`` read from ``f``) whose row groups inflate to at most
    ``inflate_limit`` of its size each, as their footer says: pyarrow holds a row group's pages inflated."""
    limit, meta = inflate_limit(_size(f)), file.metadata
    for group in range(meta.num_row_groups):
        if meta.row_group(group).total_byte_size > limit:
            raise DataError(
                f"{visible(str(path))}: row group {group} inflates to {meta.row_group(group).total_byte_size:,} bytes, "
                f"more than {limit:,} ({MAX_INFLATE_RATIO} times the file's size): refused as a compression bomb"
            )


def too_large(path: Path, what: str) -> DataError:
    return DataError(f"{what} {visible(str(path))} is read whole and has more than {MAX_DOCUMENT_BYTES:,} bytes; "
                     "write it as JSON lines (.jsonl), one row per line")


def _size(f: BinaryIO) -> int:
    return os.fstat(f.fileno()).st_size


class _Inflating:
    """A gzip stream read in blocks that stops with a DataError past ``inflate_limit``."""

    def __init__(self, raw: BinaryIO, path: Path) -> None:
        self.gzip = gzip.GzipFile(fileobj=raw, mode="rb")
        self.path, self.left = path, inflate_limit(_size(raw))
        self.limit = self.left

    def read(self, n: int) -> bytes:
        data = self.gzip.read(n)
        self.left -= len(data)
        if self.left < 0:
            raise DataError(
                f"{visible(str(self.path))} inflates to more than {self.limit:,} bytes ({MAX_INFLATE_RATIO} times its "
                "size): refused as a compression bomb; decompress it first if it is real data"
            )
        return data

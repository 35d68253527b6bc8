"""A local hf: folder's files are checked before `datasets` reads them: hostile content is one line
(a DataError) before any work, never a traceback, a crash or gigabytes (issues 46 and 47)."""

from __future__ import annotations

import bz2
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from titanctl.data import streaming
from titanctl.data.datasets import HFStreamingSource, load_documents
from titanctl.data.streaming import ShardedStream
from titanctl.errors import DataError

GOOD = b"".join(json.dumps({"text": f"document {i} about [brackets] and {{braces}}"}).encode() + b"\n"
                for i in range(40))


@pytest.fixture(autouse=True)
def _offline(offline_data):
    pass


def folder_with(tmp_path: Path, name: str, data: bytes) -> Path:
    folder = tmp_path / "repo"
    folder.mkdir(exist_ok=True)
    (folder / name).write_bytes(data)
    return folder


def windows(source, tok, n: int = 4) -> np.ndarray:
    stream = ShardedStream(source, tok, seq_len=8, n_shards=0, dp_rank=0, dp_degree=1)
    return stream.take(np.arange(n), np.ones(n, dtype=bool))


@pytest.mark.parametrize("name, data, message", [
    # 10^5 brackets: "ValueError: Reached object decoding depth limit" (66-line traceback)
    ("train.jsonl", GOOD + b"[" * 100_000 + b"]" * 100_000 + b"\n", "line 41 nests deeper than 64 levels"),
    # a row holding a 100k-deep list: SIGSEGV, no output
    ("train.jsonl", b'{"text": "x", "a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n" + GOOD,
     "line 1 nests deeper than 64 levels"),
    # UnicodeDecodeError (69-line traceback) or pyarrow's JSON errors
    ("train.jsonl", GOOD + b'{"text": "caf\xe9"}\n', r"line 41 is not UTF-8 \(byte 14 of the line\)"),
    ("train.jsonl", GOOD + b'\x00\x00{"text": "a"}\n', "line 41 holds a NUL byte: not text"),
    ("train.txt", b"hello\nwor\x00ld\n", "line 2 holds a NUL byte"),
    ("train.csv", b"text\nna\xefve\n", "line 2 is not UTF-8"),
    ("train.jsonl.gz", gzip.compress(GOOD + b'{"text": "\xff"}\n'), "line 41 is not UTF-8"),
    ("train.jsonl.bz2", bz2.compress(b"[" * 1000 + b"\n"), "line 1 nests deeper"),
    ("train.jsonl.gz", b"not gzip at all", "cannot read .*train.jsonl.gz: Not a gzipped file"),
    ("train.jsonl.zst", b"(\xb5/\xfd...", "is compressed with zstd, which titanctl does not read"),
], ids=["brackets", "deep_row", "not_utf8", "nul", "nul_txt", "csv_not_utf8", "gz_not_utf8", "bz2_deep", "bad_gz",
        "zstd"])
def test_hostile_lines_are_one_line_before_datasets_reads_them(tmp_path, name, data, message):
    folder = folder_with(tmp_path, name, data)
    with pytest.raises(DataError, match=message) as refused:
        load_documents(f"hf:{folder}")
    assert "\n" not in str(refused.value) and str(folder / name) in str(refused.value)


def test_brackets_inside_strings_are_text_not_nesting(tmp_path, tok):
    from titanctl.data import hf_folder

    text = "[" * 200 + " an ASCII-art banner " + "}" * 200 + ' and a quote \\" [[[['
    folder = folder_with(tmp_path, "train.jsonl", GOOD + json.dumps({"text": text}).encode() + b"\n")
    assert windows(load_documents(f"hf:{folder}"), tok).shape == (4, 9)
    assert hf_folder._nests_deeper(b'{"a": "[[[[[", "b": [[[1]]]}', limit=4) is False  # 4 levels
    assert hf_folder._nests_deeper(b'{"a": "[[[[[", "b": [[[1]]]}', limit=3) is True
    # A line that is no JSON at all: the brackets outside its strings decide.
    assert hf_folder._nests_deeper(b'{"a": "[[[[[", "b": [[[1', limit=4) is False
    assert hf_folder._nests_deeper(b'{"a": "[[[[[", "b": [[[1', limit=3) is True
    assert hf_folder._nests_deeper(b'"\\"[[[[[" [[[[', limit=4) is False


def test_a_link_out_of_the_folder_is_refused_and_one_inside_is_read(tmp_path, tok):
    outside = tmp_path / "passwd"
    outside.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "train.jsonl").symlink_to(outside)
    with pytest.raises(DataError, match=r"train.jsonl is a link to .*passwd, outside hf:.*repo: refusing to read it"):
        load_documents(f"hf:{folder}")
    (folder / "train.jsonl").unlink()
    (folder / "data").mkdir()
    (folder / "data" / "real.jsonl").write_bytes(GOOD)
    (folder / "train.jsonl").symlink_to(folder / "data" / "real.jsonl")
    assert windows(load_documents(f"hf:{folder}", split="train"), tok).shape == (4, 9)


def test_documents_are_bounded_in_size(tmp_path, monkeypatch, tok):
    """A 500 MB line took > 2 GiB; the limit (64 MiB) is a module constant, so a small stand-in shows it."""
    from titanctl.data import hf_folder

    assert hf_folder.MAX_DOCUMENT_BYTES == 64 << 20
    monkeypatch.setattr(hf_folder, "MAX_DOCUMENT_BYTES", 2000)
    monkeypatch.setattr(hf_folder, "_BLOCK_BYTES", 512)  # the long line spans blocks, as it would at 8 MiB
    long_line = json.dumps({"text": "x" * 2500}).encode() + b"\n"
    folder = folder_with(tmp_path, "train.jsonl", GOOD + long_line + GOOD)
    with pytest.raises(DataError, match="line 41 has more than 2,000 bytes; titanctl reads documents of at most"):
        load_documents(f"hf:{folder}")
    # datasets reads a JSON file whole from a line that starts an array: the file counts
    (folder / "train.jsonl").unlink()
    for array in (json.dumps([{"text": f"document {i}"} for i in range(200)], indent=1).encode(),
                  GOOD + b'["a row that is an array"]\n' + GOOD):
        (folder / "train.json").write_bytes(array)
        with pytest.raises(DataError, match="has more than 2,000 bytes and is read whole"):
            load_documents(f"hf:{folder}")
    (folder / "train.json").write_bytes(GOOD)  # JSON lines: 2.1 kB, each line below the limit
    assert windows(load_documents(f"hf:{folder}"), tok).shape == (4, 9)


def parquet(path: Path, table) -> Path:
    import pyarrow.parquet as pq

    path.parent.mkdir(exist_ok=True)
    pq.write_table(table, path)
    return path


def test_parquet_files_are_checked_from_their_footer(tmp_path, tok):
    import pyarrow as pa

    folder = tmp_path / "repo"
    file = parquet(folder / "train.parquet", pa.table({"text": pa.array([], pa.string())}))  # empty parquet
    with pytest.raises(DataError, match="row group 0 holds no rows, which datasets cannot read"):
        load_documents(f"hf:{folder}")
    parquet(file, pa.table({"text": pa.array([1, 2, 3])}))  # an int text column
    with pytest.raises(DataError, match="train.parquet: column 'text' holds int64 values, not text"):
        load_documents(f"hf:{folder}")
    nested = pa.int8()
    for _ in range(70):
        nested = pa.list_(nested)
    parquet(file, pa.table({"text": ["a"], "deep": pa.array([None], nested)}))
    with pytest.raises(DataError, match="is not a readable parquet file: Parquet schema too deeply nested"):
        load_documents(f"hf:{folder}")
    file.write_bytes(b"")
    with pytest.raises(DataError, match="is not a readable parquet file: Parquet file size is 0 bytes"):
        load_documents(f"hf:{folder}")
    parquet(file, pa.table({"text": [f"document {i} of a fine parquet file" for i in range(20)]}))
    assert windows(load_documents(f"hf:{folder}"), tok).shape == (4, 9)


def test_an_int_text_column_in_json_lines_is_refused_before_work(tmp_path):
    folder = folder_with(tmp_path, "train.jsonl", b'{"text": 5}\n' * 20)
    with pytest.raises(DataError, match="column 'text' holds int64 values, not text"):
        load_documents(f"hf:{folder}")


def test_other_kinds_of_files_are_refused(tmp_path):
    folder = folder_with(tmp_path, "train.arrow", b"ARROW1")
    with pytest.raises(DataError, match="read as 'arrow' data; titanctl reads JSON lines, CSV, text and parquet"):
        load_documents(f"hf:{folder}")


class _Rows:
    """A stream as `datasets` yields it, failing after its rows as a damaged hub file does."""

    num_shards = 1

    def __init__(self, rows, error=None):
        self.rows, self.error = rows, error

    def __iter__(self):
        yield from self.rows
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize("rows, error, message", [
    ([{"text": "fine"}, {"text": 7}], None, "a row's 'text' is int 7, not text"),
    ([{"text": "fine"}], ValueError("Reached object decoding depth limit\nmore"),
     r"cannot read streaming dataset hub:x \(virtual shard 0 of 1\): ValueError: Reached object decoding depth"),
])
def test_what_datasets_raises_while_streaming_is_one_line(tok, monkeypatch, rows, error, message):
    monkeypatch.setattr(streaming, "_STREAM_CHUNK_DOCS", 4)
    source = HFStreamingSource("hf:x", _Rows(rows, error), "hub:x")
    with pytest.raises(DataError, match=message) as refused:
        windows(source, tok)
    assert "\n" not in str(refused.value)

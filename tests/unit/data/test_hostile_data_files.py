"""Hostile data files, round 4 (issue 57, classes 2, 5 and 9): files that are no files (FIFOs, links to
/dev/zero) for chat, pre-training and validation data; compressed files that inflate without end;
chat rows that are too big to render (10^6 turns, a 20 MB turn, thousands of turns that a template
without generation marks renders quadratically) and JSON arrays too big to parse. Each ends in a
one-line DataError before the work, or the row is skipped and counted with its file and line, in
bounded time and memory. In-process: every case is refused or skipped before a model exists."""

from __future__ import annotations

import gzip
import json
import os
import re
import time
import tracemalloc
import zlib
from contextlib import contextmanager

import pytest

from titanctl.data import local_files
from titanctl.data.chat import MAX_CONVERSATION_CHARS, MAX_MESSAGES, ChatReport, ChatSource
from titanctl.data.chat_encode import MAX_ROW_RENDER_CHARS, BadConversation, ChatEncoder
from titanctl.data.chat_rows import MAX_ROW_BYTES
from titanctl.data.chat_template import ChatTemplate
from titanctl.data.datasets import load_documents
from titanctl.deadline import Expired, time_limit
from titanctl.errors import DataError

ANSWER = {"role": "assistant", "content": "Joshua."}
GOOD = {"messages": [{"role": "user", "content": "Who came after Moses?"}, ANSWER]}
MIB = 1 << 20


@contextmanager
def within(seconds: float):
    """Fail (instead of hanging the suite) when the body takes longer than ``seconds``."""
    try:
        with time_limit(seconds):
            yield
    except Expired:
        raise AssertionError(f"took more than {seconds} s: a hang") from None


@contextmanager
def peak_below(mib: int):
    """The Python allocations of the body peak below ``mib`` MiB (tracemalloc sees every bytes object a
    read or an inflate makes)."""
    tracemalloc.start()
    try:
        yield
    finally:
        peak = tracemalloc.get_traced_memory()[1] / MIB
        tracemalloc.stop()
    assert peak < mib, f"peak {peak:.0f} MiB"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def gzip_of_one_line(path, size: int):
    """A .gz file that inflates to ``size`` bytes of one line without a newline, written in blocks."""
    pack = zlib.compressobj(1, zlib.DEFLATED, 31)  # 31: a gzip header and trailer
    block = b"a" * MIB
    with open(path, "wb") as f:
        for _ in range(size // MIB):
            f.write(pack.compress(block))
        f.write(pack.flush())
    return path


# ----------------------------------------------------------------------------- class 2: files that are no files


def no_files(tmp_path) -> dict:
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.jsonl"
    zero.symlink_to("/dev/zero")
    zero_txt = tmp_path / "zero.txt"
    zero_txt.symlink_to("/dev/zero")
    environ = tmp_path / "environ.json"
    environ.symlink_to("/proc/self/environ")
    return {"fifo": fifo, "dev_zero": zero, "dev_zero_txt": zero_txt, "proc": environ}


@pytest.mark.parametrize("reader, kind", [
    *((reader, kind) for reader in ("chat", "validation_chat") for kind in ("fifo", "dev_zero", "proc")),
    *(("local", kind) for kind in ("fifo", "dev_zero", "dev_zero_txt", "proc")),  # chat data has no .txt files
])
def test_a_data_file_that_is_no_regular_file_is_refused_before_a_read(tmp_path, offline_data, tok, kind, reader):
    """``_content_fingerprint`` opened the file before the regular-file check: a FIFO blocked for ever,
    /dev/zero never ended."""
    path = no_files(tmp_path)[kind]
    with within(10), pytest.raises(DataError) as e:
        if reader == "local":
            source = load_documents("local", str(path))
            next(iter(source))
        else:
            ChatSource(str(path), split="validation" if reader == "validation_chat" else "train").windows(tok, 64)
    assert str(e.value).endswith("is not a regular file") and path.name in str(e.value), str(e.value)


def test_a_compressed_file_that_inflates_without_end_is_refused_in_bounded_memory(tmp_path, offline_data, tok,
                                                                                   monkeypatch):
    """A .jsonl.gz of one line with no newline: read as one line, it took its whole inflated size (a 6 MB
    file of 6 GB). Now the inflating stops at MAX_INFLATE_RATIO times the file's size (at least
    MIN_INFLATE_LIMIT, lowered here to keep the test short), holding at most a line's limit."""
    monkeypatch.setattr(local_files, "MIN_INFLATE_LIMIT", 80 * MIB)
    bomb = gzip_of_one_line(tmp_path / "bomb.jsonl.gz", 96 * MIB)
    assert bomb.stat().st_size * local_files.MAX_INFLATE_RATIO < 80 * MIB
    for read, line_limit in ((lambda: ChatSource(str(bomb)).windows(tok, 64), MAX_ROW_BYTES),
                             (lambda: list(load_documents("local", str(bomb))), local_files.MAX_DOCUMENT_BYTES)):
        with within(60), peak_below(2 * line_limit // MIB + 8), pytest.raises(DataError) as e:
            read()
        assert "bomb.jsonl.gz inflates to more than 83,886,080 bytes" in str(e.value), str(e.value)
    # a compressed file of ordinary size still reads, its lines bounded as a plain file's
    ordinary = tmp_path / "ok.jsonl.gz"
    ordinary.write_bytes(gzip.compress(("".join(json.dumps(GOOD) + "\n" for _ in range(3))).encode()))
    source = ChatSource(str(ordinary))
    source.windows(tok, 64)
    assert source.report.used == 3


def test_a_parquet_row_group_that_inflates_past_the_limit_is_refused(tmp_path, offline_data, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": [letter * MIB for letter in "abcd"]}), path, compression="zstd")
    monkeypatch.setattr(local_files, "MIN_INFLATE_LIMIT", MIB)  # the file is 4 MiB inflated, ~1 kB on disk
    with pytest.raises(DataError, match=r"docs\.parquet: row group 0 inflates to 4,\d+,\d+ bytes, more than 1,048,576"):
        list(load_documents("local", str(path)))


def test_pre_training_lines_and_documents_are_bounded(tmp_path, offline_data):
    long_line = tmp_path / "long.jsonl"
    long_line.write_bytes(b'{"text": "' + b"a" * (local_files.MAX_DOCUMENT_BYTES + 1) + b'"}\n')
    with peak_below(2 * local_files.MAX_DOCUMENT_BYTES // MIB + 16), pytest.raises(DataError) as e:
        list(load_documents("local", str(long_line)))
    assert "long.jsonl:1: a line longer than 67,108,864 bytes" in str(e.value)
    huge_txt = tmp_path / "huge.txt"
    with open(huge_txt, "wb") as f:
        f.truncate(local_files.MAX_DOCUMENT_BYTES + 1)
    with peak_below(16), pytest.raises(DataError, match="huge.txt is one document of more than 67,108,864 bytes"):
        list(load_documents("local", str(huge_txt)))


# ----------------------------------------------------------------------------- class 5: rows too big to render


def test_one_bad_row_is_skipped_and_named_not_the_whole_set_refused(tmp_path, offline_data, tok):
    """10^6 turns, a 20 MB turn, 3 Mi characters, 2,000 turns: each row skipped and counted with its
    line, the other rows trained on; the template is not blamed."""
    tiny = {"role": "user", "content": ""}
    path = tmp_path / "chat.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps(GOOD) + "\n")
        f.write(json.dumps({"messages": [tiny] * 10**6 + [ANSWER]}) + "\n")  # line 2: 28 MB
        f.write(json.dumps({"messages": [{"role": "user", "content": "x" * (20 * MIB)}, ANSWER]}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "y" * (3 << 20)}, ANSWER]}) + "\n")
        f.write(json.dumps({"messages": [tiny, ANSWER] * 1000}) + "\n")  # line 5
        f.write(json.dumps(GOOD) + "\n")
    source = ChatSource(str(path))
    with within(60), peak_below(6 * MAX_ROW_BYTES // MIB):
        source.windows(tok, 64)
    report = source.report
    assert report.used == 2 and report.rows == 6
    where = str(path)
    assert report.skipped == {f"longer than {MAX_ROW_BYTES:,} bytes": 2,
                              f"with more than {MAX_CONVERSATION_CHARS:,} characters": 1,
                              f"with more than {MAX_MESSAGES:,} messages": 1}
    summary = report.summary()
    assert f"2 rows longer than 16,777,216 bytes (first: {where}:2)" in summary
    assert re.search(rf"1 row with more than 2,097,152 characters \(first: {re.escape(where)}:4: 3,145,\d\d\d characters\)",
                     summary), summary
    assert f"1 row with more than 1,024 messages (first: {where}:5: 2,000 messages)" in summary
    assert "skipped 4 rows" in summary and "\n" not in summary


def test_a_template_without_marks_renders_a_long_conversation_within_a_bound(tok):
    """A template without generation marks renders two prefixes per assistant turn: 500 answers of a
    2 kB conversation turn rendered 500 x 1 MB. The row is skipped once its renderings pass
    MAX_ROW_RENDER_CHARS, in seconds; its turns are within MAX_MESSAGES and its text within
    MAX_CONVERSATION_CHARS."""
    template = ChatTemplate("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}"
                            "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant"
                            "<|end_header_id|>{% endif %}", "plain.jinja")
    assert not template.marks_generation
    messages = [{"role": "user", "content": "q" * 1000}, {"role": "assistant", "content": "a" * 1000}] * 500
    assert len(messages) <= MAX_MESSAGES and 2000 * 500 <= MAX_CONVERSATION_CHARS
    start = time.monotonic()
    with within(60), pytest.raises(BadConversation) as e:
        ChatEncoder(tok, template).encode(messages)
    assert e.value.reason == (f"whose renderings (two per assistant turn without {{% generation %}} marks) exceed "
                              f"{MAX_ROW_RENDER_CHARS:,} characters together")
    assert time.monotonic() - start < 30
    ids, targets = ChatEncoder(tok, template).encode(messages[:40])  # a conversation of 20 answers is fine
    assert targets.sum() > 20 * 200


def test_a_json_array_too_large_to_parse_is_refused_at_once(tmp_path, offline_data, tok):
    """A 300 MB JSON array printed nothing for 120 s; now its size is refused before it is read."""
    path = tmp_path / "rows.json"
    with open(path, "wb") as f:
        f.write(b'[{"messages": []}')
        f.truncate(300 * MIB)
    for read in (lambda: ChatSource(str(path)).windows(tok, 64), lambda: list(load_documents("local", str(path)))):
        start = time.monotonic()
        with peak_below(16), pytest.raises(DataError) as e:
            read()
        assert "rows.json is read whole and has more than 67,108,864 bytes; write it as JSON lines" in str(e.value)
        assert time.monotonic() - start < 5


# ----------------------------------------------------------------------------- class 9: counts in messages


@pytest.mark.parametrize("skips, too_long, says", [
    ({}, 4, "among 4 rows: 4 conversations longer than seq_len 64 (sft.overlong = drop)"),
    ({"nesting too deep": 1}, 0, "among 1 row: 1 row nesting too deep (first: f:1)"),
    ({"not UTF-8": 2}, 1, "among 3 rows: 2 rows not UTF-8 (first: f:1); 1 conversation longer than seq_len 64 "
                     "(sft.overlong = drop)"),
    ({}, 0, "among 0 rows: no rows"),
])
def test_refusals_count_in_words(skips, too_long, says):
    """"no rows4 longer than seq_len" and "1 rows nests too deep": one builder counts for every message."""
    report = ChatReport("d", 64)
    for reason, n in skips.items():
        for _ in range(n):
            report.skip(reason, "f:1")
    report.rows, report.too_long = sum(skips.values()) + too_long, too_long
    message = str(report.nothing_usable())
    assert message == f"chat dataset d has no usable conversation {says}"
    report.used = report.windows = 1
    assert "1 window of 64 tokens" in report.summary() and "1 of " in report.summary()

"""Issue 27, class 6: a malformed tokenizer file is a one-line DataError naming the file, whatever
is wrong in it, and its message never quotes the file's contents (a tokenizer path may be any file:
the old messages printed the offending line, so ``--tokenizer-path ~/.netrc`` showed a password)."""

from __future__ import annotations

import base64
import json
import os
import threading
import time

import pytest

from tests.unit.data.test_tokenizer import tokenizer_json
from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from titanctl.errors import DataError

MARKER = "SECRET_MARKER_91c4"


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    lines = DEFAULT_TOKENIZER_PATH.read_bytes().splitlines()
    return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in lines)}


@pytest.fixture(scope="module")
def good_spec(ranks) -> str:
    return json.dumps(tokenizer_json(ranks))


def refused(path) -> str:
    with pytest.raises(DataError) as err:
        Tokenizer(path)
    message = str(err.value)
    assert str(path) in message and "\n" not in message, message
    assert MARKER not in message, "the file's contents are in the message"
    return message


def _set(keys, value):
    def breakage(spec):
        *parents, last = keys
        for key in parents:
            spec = spec[key]
        spec[last] = value
    return breakage


def _delete(keys):
    def breakage(spec):
        *parents, last = keys
        for key in parents:
            spec = spec[key]
        del spec[last]
    return breakage


JSON_BREAKAGES = {
    # a string (or list) where a dict belongs
    "model-is-a-string": _set(["model"], MARKER),
    "vocab-is-a-string": _set(["model", "vocab"], MARKER),
    "pre-tokenizer-is-a-list": _set(["pre_tokenizer"], [MARKER]),
    "pre-tokenizer-step-is-a-string": _set(["pre_tokenizer", "pretokenizers", 0], MARKER),
    "pre-tokenizer-steps-are-a-string": _set(["pre_tokenizer", "pretokenizers"], MARKER),
    "split-pattern-is-a-string": _set(["pre_tokenizer", "pretokenizers", 0, "pattern"], MARKER),
    "split-regex-is-a-number": _set(["pre_tokenizer", "pretokenizers", 0, "pattern"], {"Regex": 5}),
    "unknown-pre-tokenizer": _set(["pre_tokenizer", "pretokenizers", 0, "type"], MARKER),
    "unknown-model-type": _set(["model", "type"], MARKER),
    "split-with-odd-behavior": _set(["pre_tokenizer", "pretokenizers", 0, "behavior"], MARKER),
    "added-tokens-is-a-dict": _set(["added_tokens"], {MARKER: 1}),
    # added tokens
    "added-token-without-content": _delete(["added_tokens", 3, "content"]),
    "added-token-is-a-string": _set(["added_tokens", 3], MARKER),
    "added-token-id-is-a-string": _set(["added_tokens", 3, "id"], MARKER),
    "added-token-id-is-a-float": _set(["added_tokens", 3, "id"], 4099.5),
    "added-token-id-is-true": _set(["added_tokens", 3, "id"], True),
    # ranks in the vocab
    "vocab-rank-is-a-string": _set(["model", "vocab", "a"], MARKER),
    "vocab-rank-is-a-float": _set(["model", "vocab", "a"], 65.5),
    "vocab-rank-is-negative": _set(["model", "vocab", "a"], -1),
    "vocab-rank-is-huge": _set(["model", "vocab", "a"], 10**30),
    "vocab-token-outside-the-alphabet": _set(["model", "vocab", f"{MARKER}\u2603"], 4000),
    # merges
    "merge-without-a-space": _set(["model", "merges", 7], MARKER),
    "merge-of-one-token": _set(["model", "merges", 7], [MARKER]),
    "merge-of-three-tokens": _set(["model", "merges", 7], ["a", "b", MARKER]),
    "merge-of-numbers": _set(["model", "merges", 7], [1, 2]),
    "merge-is-a-dict": _set(["model", "merges", 7], {MARKER: MARKER}),
    "merge-of-unknown-tokens": _set(["model", "merges", 7], [MARKER, MARKER]),
}


@pytest.mark.parametrize("breakage", JSON_BREAKAGES)
def test_a_malformed_tokenizer_json_is_a_one_line_data_error(tmp_path, good_spec, breakage):
    spec = json.loads(good_spec)
    JSON_BREAKAGES[breakage](spec)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    refused(path)


def test_the_unbroken_tokenizer_json_loads(tmp_path, good_spec):
    path = tmp_path / "tokenizer.json"
    path.write_text(good_spec)
    assert Tokenizer(path).vocab_size == 4352


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"model": ' * 5000 + "1" + "}" * 5000],
                         ids=["list-1e5-deep", "dict-5e3-deep"])
def test_a_deeply_nested_tokenizer_json_is_refused_before_parsing(tmp_path, text):
    path = tmp_path / "tokenizer.json"
    path.write_text(text)
    assert "nests deeper" in refused(path)


def test_a_tokenizer_json_that_is_not_utf8_is_refused(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(b'{"model": "\xff\xfe' + MARKER.encode() + b'"}')
    assert "UTF-8" in refused(path)


RANK_BREAKAGES = {
    "non-integer-rank": b"1.5",
    "infinite-rank": b"inf",
    "nan-rank": b"nan",
    "exponent-rank": b"1e3",
    "signed-rank": b"+5",
    "negative-rank": b"-5",
    "underscored-rank": b"1_0",
    "arabic-digit-rank": "\u0665".encode(),
    "huge-rank": b"1" + b"0" * 5000,
    "no-rank": b"",
    "two-ranks": b"5 6",
}


@pytest.mark.parametrize("breakage", RANK_BREAKAGES)
def test_a_bad_rank_in_a_tiktoken_file_is_a_one_line_data_error(tmp_path, breakage):
    lines = DEFAULT_TOKENIZER_PATH.read_bytes().splitlines()
    token = lines[300].split()[0]
    lines[300] = b" ".join(filter(None, [token + MARKER.encode()[:0], RANK_BREAKAGES[breakage]]))
    lines.append(MARKER.encode())  # a line the old parser would have quoted, if it got there
    path = tmp_path / "tokenizer.model"
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert "line 301" in refused(path)


def test_a_token_that_is_not_base64_is_a_one_line_data_error(tmp_path):
    lines = DEFAULT_TOKENIZER_PATH.read_bytes().splitlines()
    lines[5] = MARKER.encode() + b"!! 5"
    path = tmp_path / "tokenizer.model"
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert "line 6" in refused(path)


@pytest.mark.parametrize("kind", ["proc", "fifo", "directory"])
def test_a_tokenizer_that_is_not_a_regular_file_is_refused_at_once(tmp_path, monkeypatch, kind):
    monkeypatch.setenv("TITANCTL_TEST_SECRET", MARKER)  # in /proc/self/environ
    path = {"proc": "/proc/self/environ", "fifo": tmp_path / "fifo", "directory": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
        # Opening a FIFO for reading blocked until a writer came: one comes late, so a test of code
        # that blocks fails on the time bound instead of hanging.
        late_writer = threading.Timer(15, lambda: os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK)))
        late_writer.start()
    started = time.monotonic()
    try:
        assert "not a regular file" in refused(path)
    finally:
        if kind == "fifo":
            late_writer.cancel()
    assert time.monotonic() - started < 10

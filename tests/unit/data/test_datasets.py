"""Dataset registry: bundled corpus, local files, c4 when offline, helpful errors."""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from titanctl.data import datasets as registry
from titanctl.data.datasets import load_documents
from titanctl.errors import DataError

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")


def write_jsonl(path: Path, texts: list[str]) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t, "meta": 1}) + "\n")
    return path


def test_bundled_is_finite_and_has_plays_and_bible():
    source = load_documents("bundled", None)
    assert not source.streaming
    docs = list(source)
    assert len(docs) > 1500
    assert docs[0].startswith("A Midsummer Night's Dream\nACT I, SCENE I.")
    assert any(d.startswith("Genesis 1\n") for d in docs)
    assert not any("**" in d or "\\[" in d for d in docs)  # Markdown markup is gone


def test_bundled_val_is_held_out():
    val = list(load_documents("bundled_val"))
    assert 20 < len(val) < 200
    assert any(d.startswith("The Tempest\n") for d in val)
    train = list(load_documents("bundled"))
    assert not any(d.startswith("The Tempest\n") or d.startswith("Ruth 1\n") for d in train)
    assert sum(map(len, val)) < 0.06 * sum(map(len, train))


def test_fingerprints_identify_content():
    assert load_documents("bundled").fingerprint == load_documents("bundled").fingerprint
    assert load_documents("bundled").fingerprint != load_documents("bundled_val").fingerprint


def test_bundled_and_tokenizer_do_not_import_heavy_libraries():
    code = (
        "import sys\n"
        "from titanctl.data.datasets import load_documents\n"
        "from titanctl.data.tokenizer import Tokenizer\n"
        "docs = list(load_documents('bundled'))\n"
        "Tokenizer().encode(docs[0], bos=True, eos=True)\n"
        "heavy = [m for m in ('datasets', 'torch', 'pyarrow') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_local_jsonl(tmp_path, suffix):
    path = write_jsonl(tmp_path / f"data{suffix}", ["first doc", "second\ndoc", "third ✓"])
    source = load_documents("local", str(path))
    assert not source.streaming
    assert list(source) == ["first doc", "second\ndoc", "third ✓"]


def test_local_json_list_and_json_lines(tmp_path):
    as_list = tmp_path / "list.json"
    as_list.write_text(json.dumps([{"text": "a"}, {"text": "b"}, "c"]))
    assert list(load_documents("local", str(as_list))) == ["a", "b", "c"]
    as_lines = write_jsonl(tmp_path / "lines.json", ["x", "y"])
    assert list(load_documents("local", str(as_lines))) == ["x", "y"]


def test_local_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"id": [1, 2], "text": ["one", "two"]}), path)
    assert list(load_documents("local", str(path))) == ["one", "two"]
    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match="no 'text' column"):
        list(load_documents("local", str(tmp_path / "bad.parquet")))


def test_local_txt_is_one_document_per_file(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("Chapter 1\n\nIt was a dark night.\n", encoding="utf-8")
    assert list(load_documents("local", str(path))) == ["Chapter 1\n\nIt was a dark night.\n"]


def test_local_folder_reads_supported_files_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    write_jsonl(tmp_path / "b" / "part.jsonl", ["from b"])
    (tmp_path / "a.txt").write_text("from a")
    (tmp_path / "c.csv").write_text("ignored,file\n")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("hidden")
    source = load_documents("local", str(tmp_path))
    assert list(source) == ["from a", "from b"]


def test_local_fingerprint_follows_content(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["one"])
    before = load_documents("local", str(path)).fingerprint
    assert load_documents("local", str(path)).fingerprint == before
    write_jsonl(path, ["two"])
    assert load_documents("local", str(path)).fingerprint != before


def test_local_errors_name_the_offending_value(tmp_path):
    with pytest.raises(DataError, match="does-not-exist.jsonl"):
        load_documents("local", str(tmp_path / "does-not-exist.jsonl"))
    with pytest.raises(DataError, match="dataset_path"):
        load_documents("local", None)
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"data\.csv.*\.jsonl"):
        load_documents("local", str(tmp_path / "data.csv"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="holds no"):
        load_documents("local", str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        list(load_documents("local", str(bad)))
    bad.write_text("{not json\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:1: not valid JSON"):
        list(load_documents("local", str(bad)))
    deep = "[" * 100_000 + "]" * 100_000  # RecursionError in Python's parser: a traceback before
    bad.write_text('{"text": "ok"}\n' + deep + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: nests too deep to read"):
        list(load_documents("local", str(bad)))
    (tmp_path / "bad.json").write_text(deep)
    with pytest.raises(DataError, match=r"bad\.json: nests too deep to read"):
        list(load_documents("local", str(tmp_path / "bad.json")))


def test_a_path_implies_local(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", ["my own text"])
    source = load_documents("bundled", str(path))  # the default name plus dataset_path
    assert source.name == "local" and list(source) == ["my own text"]


@pytest.mark.parametrize("name", ["bundled_val", "c4"])
def test_path_with_another_named_dataset_is_rejected(tmp_path, name):
    with pytest.raises(DataError, match=f"dataset '{name}' takes no path"):
        load_documents(name, str(tmp_path))


@pytest.mark.parametrize(
    "name, suggestion", [("bundle", "bundled"), ("c5", "c4"), ("bundled-val", "bundled_val")]
)
def test_unknown_name_suggests_the_nearest(name, suggestion):
    with pytest.raises(DataError, match=f"did you mean '{suggestion}'") as err:
        load_documents(name)
    assert "bundled, bundled_val, c4, local" in str(err.value)


@pytest.fixture
def network(monkeypatch) -> list[str]:
    """Every DNS lookup and connection attempted while the test runs, in order (they still happen)."""
    attempts: list[str] = []
    connect, getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def recording_connect(self, address):
        attempts.append(f"connect {address}")
        return connect(self, address)

    def recording_getaddrinfo(host, port, *args, **kwargs):
        attempts.append(f"resolve {host}:{port}")
        return getaddrinfo(host, port, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", recording_connect)
    monkeypatch.setattr(socket, "getaddrinfo", recording_getaddrinfo)
    return attempts


def test_c4_offline_fails_fast_with_a_hint(network):
    """Fast: without touching the network (no lookup, no connection, so no retries)."""
    with pytest.raises(DataError) as err:
        load_documents("c4")
    assert network == []
    message = str(err.value)
    assert message.startswith("cannot load allenai/c4 from the Hugging Face hub (offline or unreachable): ")
    assert message.endswith("use training.dataset=bundled or training.dataset_path=FILE")
    assert "\n" not in message


def test_c4_failure_inside_datasets_becomes_data_error(monkeypatch, network):
    # Skip our own reachability check so the real load_dataset call runs (and fails offline).
    import datasets
    import huggingface_hub

    monkeypatch.setattr(registry, "_hub_unreachable", lambda: None)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match=r"^cannot load allenai/c4 .*dataset_path=FILE$"):
        load_documents("c4")
    assert network == []  # datasets' offline mode: no lookup, no connection, so no retries


def test_unreachable_hub_is_detected_without_offline_variables(monkeypatch, network):
    for var in (
        "HF_HUB_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "HTTPS_PROXY",
        "https_proxy",
        "ALL_PROXY",
        "all_proxy",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    assert "127.0.0.1:9" in registry._hub_unreachable()
    assert [a for a in network if a.startswith("connect")] == ["connect ('127.0.0.1', 9)"]  # one try, no retries


def test_build_corpus_script_regenerates_the_shipped_files(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "build_corpus.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr
    shipped = REPO / "titanctl" / "assets" / "corpus"
    for split in ("train", "val"):
        assert (tmp_path / f"{split}.jsonl.gz").read_bytes() == (shipped / f"{split}.jsonl.gz").read_bytes()

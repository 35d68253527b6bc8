"""Streaming datasets (hf:, c4's code path): virtual shards, layout-independent samples, and exact
resume after a change of data-parallel degree. Offline, on a local folder laid out like a hub repo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from titanctl.data import streaming
from titanctl.data.dataloader import TokenWindowLoader
from titanctl.data.datasets import load_documents
from titanctl.data.mixture import WeightedSource
from titanctl.errors import DataError

SEQ_LEN = 16
G = 8


@pytest.fixture(autouse=True)
def _offline_small_refills(offline_data, monkeypatch):
    # Pull 2 documents per refill, so that a saved state lands in the middle of each shard's stream.
    monkeypatch.setattr(streaming, "_STREAM_CHUNK_DOCS", 2)


def hub_folder(root: Path, n_files: int = 2, docs_per_file: int = 40) -> Path:
    """A dataset repo as the hub lays it out: data/train-0000k-of-0000n.jsonl, unique words per document."""
    (root / "data").mkdir(parents=True)
    for k in range(n_files):
        with (root / "data" / f"train-{k:05d}-of-{n_files:05d}.jsonl").open("w") as f:
            for i in range(docs_per_file):
                words = " ".join(f"f{k}d{i}x{j}" for j in range(3 + (i * 5) % 13))
                f.write(json.dumps({"text": f"File {k} doc {i}: {words}.", "id": i}) + "\n")
    return root


@pytest.fixture
def folder(tmp_path) -> Path:
    return hub_folder(tmp_path / "repo")


def make(folder, tok, *, dp=1, rank=0, lb=G, shards=0, extra=()) -> TokenWindowLoader:
    source = load_documents(f"hf:{folder}")
    sources = [WeightedSource("stream", source, 0.6), *extra] if extra else source
    return TokenWindowLoader(
        sources, tok, seq_len=SEQ_LEN, global_batch_size=G, local_batch_size=lb, dp_rank=rank, dp_degree=dp,
        seed=0, stream_shards=shards,
    )


def run(ranks: list[TokenWindowLoader], steps: int) -> list[torch.Tensor]:
    """Each step's global batch (G, seq_len + 1), reassembled from every rank."""
    dp, out = len(ranks), []
    for _ in range(steps):
        batch = torch.empty(G, SEQ_LEN + 1, dtype=torch.int64)
        for r, rank in enumerate(ranks):
            lb = rank.local_batch_size
            for m, (inputs, labels) in enumerate(rank.next_step()):
                batch[m * dp * lb + r + dp * torch.arange(lb)] = torch.cat([inputs, labels[:, -1:]], dim=1)
        out.append(batch)
    return out


def merged(states: list[dict]) -> dict:
    """What a DCP checkpoint keeps of the ranks' states: one copy of each key, which all ranks
    that have the key must agree on."""
    out: dict = {}

    def merge(into: dict, state: dict, path: str) -> None:
        for key, value in state.items():
            if isinstance(value, dict):
                merge(into.setdefault(key, {}), value, f"{path}.{key}")
            else:
                assert into.get(key, value) == value, f"ranks disagree on {path}.{key}"
                into[key] = value

    for state in states:
        merge(out, json.loads(json.dumps(state)), "dataloader")
    return out


def test_hf_folder_streams_offline_with_one_shard_per_file(folder, tok):
    source = load_documents(f"hf:{folder}")
    assert source.streaming and source.num_shards == 2
    docs = list(source)
    assert len(docs) == 80 and docs[0].startswith("File 0 doc 0:")
    loader = make(folder, tok, dp=2, rank=1, lb=4)
    assert sorted(loader._readers[0].shards) == [1]  # DP 2 divides 2 shards: rank 1 reads shard 1 only
    assert sorted(make(folder, tok, dp=4, rank=3, lb=2)._readers[0].shards) == [1]
    assert sorted(make(folder, tok, dp=2, rank=0, lb=4, shards=6)._readers[0].shards) == [0, 2, 4]


@pytest.mark.parametrize("shards", [0, 4])
@pytest.mark.parametrize("dp, lb", [(2, 4), (4, 2), (2, 1), (4, 1)])
def test_stream_global_batch_is_independent_of_the_layout(folder, tok, shards, dp, lb):
    reference = run([make(folder, tok, shards=shards)], 5)
    got = run([make(folder, tok, dp=dp, rank=r, lb=lb, shards=shards) for r in range(dp)], 5)
    for step, (want, have) in enumerate(zip(reference, got, strict=True)):
        assert torch.equal(want, have), f"step {step} differs for dp={dp} lb={lb} shards={shards}"
    rows = {tuple(r) for b in reference for r in b.tolist()}
    assert len(rows) == 5 * G  # no window repeated


@pytest.mark.parametrize(
    "dp_before, lb_before, dp_after, lb_after, shards",
    [(2, 4, 1, 8, 0), (2, 4, 4, 2, 0), (2, 2, 4, 1, 4), (4, 2, 2, 4, 0), (1, 8, 2, 4, 0)],
)
def test_stream_resumes_exactly_after_a_change_of_dp_degree(
    folder, tok, dp_before, lb_before, dp_after, lb_after, shards
):
    uninterrupted = run([make(folder, tok, shards=shards)], 7)
    before = [make(folder, tok, dp=dp_before, rank=r, lb=lb_before, shards=shards) for r in range(dp_before)]
    run(before, 3)
    state = merged([rank.state_dict() for rank in before])
    stream_state = state["streams"]["source0"]
    assert len(stream_state) == (shards or 2)  # the ranks together saved every virtual shard
    # A saved shard holds fewer tokens than the next steps need: resuming reads on from the
    # restored stream positions, not merely the saved leftovers.
    assert sum(len(json.loads(s)["buffer"]) for s in stream_state.values()) < 4 * G * (SEQ_LEN + 1)
    after = [make(folder, tok, dp=dp_after, rank=r, lb=lb_after, shards=shards) for r in range(dp_after)]
    for rank in after:
        rank.load_state_dict(state)
    for step, (want, got) in enumerate(zip(uninterrupted[3:], run(after, 4), strict=True)):
        assert torch.equal(want, got), f"step {step + 4} differs after resuming dp {dp_before} -> {dp_after}"


def test_mixture_of_a_stream_and_a_finite_source_resumes_across_layouts(folder, tmp_path, tok):
    local = tmp_path / "local.jsonl"
    local.write_text("".join(json.dumps({"text": f"local {i}: " + "word " * (5 + i)}) + "\n" for i in range(30)))

    def extra():
        return (WeightedSource(str(local), load_documents("local", str(local)), 0.4),)

    uninterrupted = run([make(folder, tok, extra=extra())], 6)
    before = [make(folder, tok, dp=2, rank=r, lb=4, extra=extra()) for r in range(2)]
    run(before, 2)
    state = merged([rank.state_dict() for rank in before])
    assert sum(state["drawn"]) == 2 * G and min(state["drawn"]) > 0
    after = [make(folder, tok, dp=4, rank=r, lb=1, extra=extra()) for r in range(4)]
    for rank in after:
        rank.load_state_dict(state)
    for want, got in zip(uninterrupted[2:], run(after, 4), strict=True):
        assert torch.equal(want, got)
    tokens = after[0].tokens_by_source()
    assert set(tokens) == {"stream", str(local)} and sum(tokens.values()) == 6 * G * SEQ_LEN


def test_another_number_of_shards_refuses_the_state(folder, tok):
    loader = make(folder, tok, shards=4)
    loader.next_step()
    with pytest.raises(DataError, match="stream_shards '4' in the checkpoint vs '2' now"):
        make(folder, tok).load_state_dict(loader.state_dict())


def test_exhausted_stream_raises_data_error(tmp_path, tok):
    loader = make(hub_folder(tmp_path / "short", docs_per_file=2), tok)
    with pytest.raises(DataError, match=r"ran out of documents \(virtual shard [01] of 2\)"):
        for _ in range(10):
            loader.next_step()


def test_missing_text_field_and_bad_names_are_data_errors(folder, tmp_path, tok):
    with pytest.raises(DataError, match="has no 'body' column \\(columns: text, id\\); set text_field"):
        load_documents(f"hf:{folder}", text_field="body")  # before any work: the columns are known
    with pytest.raises(DataError, match="Bad split: validation"):
        load_documents(f"hf:{folder}", split="validation")
    with pytest.raises(DataError, match="folder '/no/such/folder' does not exist"):
        load_documents("hf:/no/such/folder")
    with pytest.raises(DataError, match="cannot load someone/corpus from the Hugging Face hub .*HF_HUB_OFFLINE=1"):
        load_documents("hf:someone/corpus")
    with pytest.raises(DataError, match="'hf:' names nothing"):
        load_documents("hf:")
    with pytest.raises(DataError, match="takes no path"):
        load_documents(f"hf:{folder}", str(tmp_path))

"""TokenWindowLoader: packing, determinism, layout invariance, resume and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from titanctl.data.dataloader import TokenWindowLoader, tokenize_finite
from titanctl.data.datasets import load_documents
from titanctl.data.tokenizer import Tokenizer
from titanctl.errors import DataError

SEQ_LEN = 16
G = 8  # global batch size (sequences)


pytestmark = pytest.mark.usefixtures("offline_data")


def make_corpus(path: Path, n_docs: int = 8, tag: str = "w") -> Path:
    """Documents of different lengths, so windows straddle document boundaries.

    Every word is unique (and starts with ``tag``: corpora of different tags share no word), so no
    two windows hold the same tokens.
    """
    with path.open("w", encoding="utf-8") as f:
        for i in range(n_docs):
            words = " ".join(f"{tag}{i}x{k}" for k in range(3 + (i * 5) % 17))
            f.write(json.dumps({"text": f"Doc {i}: {words}."}) + "\n")
    return path


@pytest.fixture
def corpus(tmp_path) -> Path:
    return make_corpus(tmp_path / "corpus.jsonl")


def loader(corpus, tok, *, lb=G, dp=1, rank=0, gbs=G, seed=0, seq_len=SEQ_LEN) -> TokenWindowLoader:
    return TokenWindowLoader(
        load_documents("local", str(corpus)),
        tok,
        seq_len=seq_len,
        global_batch_size=gbs,
        local_batch_size=lb,
        dp_rank=rank,
        dp_degree=dp,
        seed=seed,
    )


def global_batches(corpus, tok, steps: int, *, dp: int, lb: int, state=None) -> list[torch.Tensor]:
    """Run every rank of a DP layout and reassemble each step's global batch (G, seq_len + 1)."""
    ranks = [loader(corpus, tok, lb=lb, dp=dp, rank=r) for r in range(dp)]
    if state is not None:
        for rank in ranks:
            rank.load_state_dict(state)
    out = []
    for _ in range(steps):
        batch = torch.empty(G, SEQ_LEN + 1, dtype=torch.int64)
        for r, rank in enumerate(ranks):
            for m, (inputs, labels) in enumerate(rank.next_step()):
                # Rank r holds the step's samples r, r + dp, r + 2 dp, ...; microbatch m the m-th lb of them.
                samples = m * dp * lb + r + dp * torch.arange(lb)
                # Rebuild full windows: inputs plus the last label.
                batch[samples] = torch.cat([inputs, labels[:, -1:]], dim=1)
        out.append(batch)
    return out


def test_packing_puts_bos_eos_at_document_boundaries(corpus, tok):
    source = load_documents("local", str(corpus))
    tokens = tokenize_finite(source, tok)
    assert tokens.dtype == np.int32
    expected = [i for doc in source for i in tok.encode(doc, bos=True, eos=True)]
    assert tokens.tolist() == expected
    assert tokens[0] == tok.bos_id and tokens[-1] == tok.eos_id
    n_docs = sum(1 for _ in source)
    assert (tokens == tok.bos_id).sum() == n_docs == (tokens == tok.eos_id).sum()
    # every EOS but the last is followed by the next document's BOS
    after_eos = np.flatnonzero(tokens == tok.eos_id)[:-1] + 1
    assert (tokens[after_eos] == tok.bos_id).all()


def test_microbatches_are_shifted_windows_of_seq_len_plus_one(corpus, tok):
    source = load_documents("local", str(corpus))
    tokens = tokenize_finite(source, tok)
    loader_ = loader(corpus, tok, lb=2, dp=1, gbs=8)
    assert loader_.grad_accum_steps == 4
    n_windows = len(tokens) // (SEQ_LEN + 1)
    assert loader_.n_windows == n_windows
    all_windows = {tuple(w) for w in tokens[: n_windows * (SEQ_LEN + 1)].reshape(n_windows, -1).tolist()}
    microbatches = loader_.next_step()
    assert len(microbatches) == 4
    for inputs, labels in microbatches:
        assert inputs.shape == labels.shape == (2, SEQ_LEN)
        assert inputs.dtype == labels.dtype == torch.int64
        assert torch.equal(inputs[:, 1:], labels[:, :-1])
        for row in torch.cat([inputs, labels[:, -1:]], dim=1).tolist():
            assert tuple(row) in all_windows


def test_each_epoch_visits_every_window_once_in_a_new_order(corpus, tok):
    loader_ = loader(corpus, tok, lb=1, gbs=1)
    n = loader_.n_windows
    seen = [
        tuple(torch.cat([inputs, labels[:, -1:]], 1)[0].tolist())
        for inputs, labels in (loader_.next_step()[0] for _ in range(2 * n))
    ]
    first, second = seen[:n], seen[n:]
    assert len(set(first)) == n and set(first) == set(second)
    assert first != second  # a fresh permutation per epoch


def test_same_seed_same_batches_different_seed_different(corpus, tok):
    a, b, c = (loader(corpus, tok, seed=s) for s in (7, 7, 8))
    for _ in range(3):
        (xa, ya), (xb, yb), (xc, _) = a.next_step()[0], b.next_step()[0], c.next_step()[0]
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(xa, xc)


def test_global_rng_does_not_change_the_order(corpus, tok):
    torch.manual_seed(0)
    np.random.seed(0)
    first = loader(corpus, tok).next_step()[0][0]
    torch.manual_seed(123)
    np.random.seed(123)
    torch.rand(100)
    assert torch.equal(loader(corpus, tok).next_step()[0][0], first)


@pytest.mark.parametrize(
    "dp, lb",
    [(1, 8), (2, 4), (4, 2), (1, 2), (2, 2), (2, 1), (4, 1)],  # the last four accumulate gradients
)
def test_global_batch_is_independent_of_the_data_parallel_layout(corpus, tok, dp, lb):
    # 5 steps of 8 samples cross an epoch boundary of this corpus's 23 windows.
    reference = global_batches(corpus, tok, 5, dp=1, lb=G)
    assert loader(corpus, tok).n_windows < 5 * G
    for step, (want, got) in enumerate(
        zip(reference, global_batches(corpus, tok, 5, dp=dp, lb=lb), strict=True)
    ):
        assert torch.equal(want, got), f"step {step} differs for dp={dp} lb={lb}"


def test_state_dict_is_the_same_on_every_rank_and_layout(corpus, tok):
    states = []
    for dp, lb in [(1, 8), (2, 4), (4, 1)]:
        for rank in range(dp):
            loader_ = loader(corpus, tok, lb=lb, dp=dp, rank=rank)
            loader_.next_step()
            loader_.next_step()
            states.append(loader_.state_dict())
    assert all(s == states[0] for s in states)
    assert states[0]["samples_consumed"] == 2 * G


@pytest.mark.parametrize(
    "dp_before, lb_before, dp_after, lb_after", [(2, 4, 2, 4), (2, 4, 4, 1), (4, 2, 1, 8)]
)
def test_resume_continues_exactly(corpus, tok, dp_before, lb_before, dp_after, lb_after):
    uninterrupted = global_batches(corpus, tok, 6, dp=1, lb=G)
    first = loader(corpus, tok, lb=lb_before, dp=dp_before, rank=dp_before - 1)
    for _ in range(2):
        first.next_step()
    state = json.loads(json.dumps(first.state_dict()))  # survives a plain serialization
    resumed = global_batches(corpus, tok, 4, dp=dp_after, lb=lb_after, state=state)
    for want, got in zip(uninterrupted[2:], resumed, strict=True):
        assert torch.equal(want, got)


@pytest.mark.parametrize(
    "change, mentions",
    [({"seed": 1}, "seed"), ({"seq_len": 8}, "seq_len"), ({"corpus": "other"}, "dataset")],
)
def test_fingerprint_mismatch_says_what_differs(tmp_path, corpus, tok, change, mentions):
    state = loader(corpus, tok).state_dict()
    other_corpus = make_corpus(tmp_path / "other.jsonl", n_docs=9) if "corpus" in change else corpus
    kwargs = {k: v for k, v in change.items() if k != "corpus"}
    with pytest.raises(DataError, match=mentions):
        loader(other_corpus, tok, **kwargs).load_state_dict(state)


def test_other_tokenizer_is_a_fingerprint_mismatch(tmp_path, corpus, tok):
    state = loader(corpus, tok).state_dict()
    ranks = Tokenizer().path.read_bytes().splitlines()[:300]  # a smaller, different tokenizer
    (tmp_path / "small.model").write_bytes(b"\n".join(ranks) + b"\n")
    with pytest.raises(DataError, match="tokenizer"):
        loader(corpus, Tokenizer(tmp_path / "small.model")).load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs, mentions",
    [
        ({"gbs": 12, "lb": 8}, "global_batch_size=12"),
        ({"gbs": 8, "lb": 3}, "global_batch_size=8"),
        ({"dp": 2, "rank": 2, "lb": 4}, "rank 2"),
        ({"seq_len": 0}, "seq_len=0"),
        ({"seed": -1}, "seed=-1"),
    ],
)
def test_invalid_settings_raise_data_error(corpus, tok, kwargs, mentions):
    with pytest.raises(DataError, match=mentions):
        loader(corpus, tok, **kwargs)


def test_corpus_smaller_than_a_global_batch_is_rejected(tmp_path, tok):
    tiny = make_corpus(tmp_path / "tiny.jsonl", n_docs=2)
    with pytest.raises(DataError, match="fewer than one global batch of 8"):
        loader(tiny, tok)


def test_token_cache_is_reused_and_survives_corruption(tmp_path, corpus, tok, monkeypatch):
    source = load_documents("local", str(corpus))
    fresh = tokenize_finite(source, tok)
    cached = list((tmp_path / "titanctl_cache" / "tokens").glob("*.npy"))
    assert len(cached) == 1
    assert np.array_equal(np.load(cached[0]), fresh)
    assert np.array_equal(tokenize_finite(source, tok), fresh)
    cached[0].write_bytes(b"not an npy file")
    assert np.array_equal(tokenize_finite(source, tok), fresh)
    monkeypatch.setenv("TITANCTL_CACHE_DIR", "")
    cached[0].unlink()
    tokenize_finite(source, tok)
    assert not cached[0].exists()

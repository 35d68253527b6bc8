"""Data mixtures: the sampler, the mixed loader (layout independence, resume) and the config tables."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.data.test_loader import make_corpus
from titanctl.config.recipe import load_config, to_toml
from titanctl.data.dataloader import TokenWindowLoader, tokenize_finite
from titanctl.data.datasets import load_documents
from titanctl.data.mixture import MixtureSampler, WeightedSource, sources_from_config
from titanctl.errors import ConfigError, DataError

SEQ_LEN = 16
G = 8


pytestmark = pytest.mark.usefixtures("offline_data")


@pytest.fixture
def corpora(tmp_path) -> list[Path]:
    # A big one and a small one: the small one runs through several epochs in a few steps.
    return [make_corpus(tmp_path / "big.jsonl", 30, tag="b"), make_corpus(tmp_path / "small.jsonl", 3, tag="s")]


def mixture(corpora, weights=(0.7, 0.3)) -> list[WeightedSource]:
    return [
        WeightedSource(str(path), load_documents("local", str(path)), w) for path, w in zip(corpora, weights)
    ]


def make_loader(sources, tok, *, dp=1, rank=0, lb=G, seed=0) -> TokenWindowLoader:
    return TokenWindowLoader(
        sources, tok, seq_len=SEQ_LEN, global_batch_size=G, local_batch_size=lb, dp_rank=rank,
        dp_degree=dp, seed=seed,
    )


def global_batches(make, steps: int, *, dp: int, lb: int, state=None) -> list[torch.Tensor]:
    """Every rank of a DP layout, each step's global batch reassembled: (G, seq_len + 1)."""
    ranks = [make(dp=dp, rank=r, lb=lb) for r in range(dp)]
    for rank in ranks:
        if state is not None:
            rank.load_state_dict(state)
    out = []
    for _ in range(steps):
        batch = torch.empty(G, SEQ_LEN + 1, dtype=torch.int64)
        for r, rank in enumerate(ranks):
            for m, (inputs, labels) in enumerate(rank.next_step()):
                samples = m * dp * lb + r + dp * torch.arange(lb)  # rank r: samples r, r + dp, ...
                batch[samples] = torch.cat([inputs, labels[:, -1:]], dim=1)
        out.append(batch)
    return out


# ---- the sampler --------------------------------------------------------------------


def test_sampler_is_a_pure_function_of_seed_and_sample_index():
    sampler = MixtureSampler([0.5, 0.25, 0.25], seed=3)
    ids = np.arange(10_000)
    whole = sampler.choose(ids)
    pieces = np.concatenate([sampler.choose(ids[i : i + 7]) for i in range(0, len(ids), 7)])
    assert np.array_equal(whole, pieces)  # no hidden state: any chunking gives the same draws
    assert np.array_equal(whole[::-1], sampler.choose(ids[::-1]))
    assert np.array_equal(whole, MixtureSampler([0.5, 0.25, 0.25], seed=3).choose(ids))
    assert not np.array_equal(whole, MixtureSampler([0.5, 0.25, 0.25], seed=4).choose(ids))
    assert set(np.unique(whole)) == {0, 1, 2}


@pytest.mark.parametrize("weights", [(0.7, 0.3), (1, 2, 3, 4), (5.0, 0.01)])
def test_sampler_follows_the_weights(weights):
    n = 200_000
    counts = np.bincount(MixtureSampler(weights, seed=11).choose(np.arange(n)), minlength=len(weights))
    p = np.asarray(weights, dtype=float) / sum(weights)
    sigma = np.sqrt(n * p * (1 - p))
    assert np.all(np.abs(counts - n * p) < 5 * sigma), (counts, n * p)


def test_sampler_refuses_bad_weights():
    for weights in ([], [1.0, 0.0], [1.0, -2.0], [float("nan")], [float("inf"), 1.0]):
        with pytest.raises(DataError, match="must be finite and > 0"):
            MixtureSampler(weights, seed=0)


# ---- the mixed loader ---------------------------------------------------------------


def windows_of(path: Path, tok) -> set[tuple[int, ...]]:
    tokens = tokenize_finite(load_documents("local", str(path)), tok)
    n = len(tokens) // (SEQ_LEN + 1)
    return {tuple(w) for w in tokens[: n * (SEQ_LEN + 1)].reshape(n, -1).tolist()}


def test_each_sample_comes_from_the_source_the_sampler_chose(corpora, tok):
    steps = 6
    (batches,) = [global_batches(lambda **kw: make_loader(mixture(corpora), tok, **kw), steps, dp=1, lb=G)]
    chosen = MixtureSampler([0.7, 0.3], seed=0).choose(np.arange(steps * G))
    big, small = windows_of(corpora[0], tok), windows_of(corpora[1], tok)
    rows = torch.cat(batches).tolist()
    for row, source in zip(rows, chosen, strict=True):
        assert tuple(row) in (big if source == 0 else small)
    # The small source cycles through its windows: every epoch visits each window once.
    from_small = [tuple(r) for r, s in zip(rows, chosen) if s == 1]
    n_small = len(small)
    assert len(from_small) > n_small
    assert set(from_small[:n_small]) == small


@pytest.mark.parametrize("dp, lb", [(2, 4), (4, 2), (2, 2), (4, 1), (1, 2)])
def test_mixed_global_batch_is_independent_of_the_layout(corpora, tok, dp, lb):
    make = lambda **kw: make_loader(mixture(corpora), tok, **kw)  # noqa: E731
    reference = global_batches(make, 5, dp=1, lb=G)
    for step, (want, got) in enumerate(zip(reference, global_batches(make, 5, dp=dp, lb=lb), strict=True)):
        assert torch.equal(want, got), f"step {step} differs for dp={dp} lb={lb}"


@pytest.mark.parametrize("dp_before, dp_after, lb_after", [(2, 2, 4), (2, 1, 8), (2, 4, 1), (4, 1, 2)])
def test_mixed_resume_is_exact_under_any_layout(corpora, tok, dp_before, dp_after, lb_after):
    make = lambda **kw: make_loader(mixture(corpora), tok, **kw)  # noqa: E731
    uninterrupted = global_batches(make, 6, dp=1, lb=G)
    states = []
    for rank in range(dp_before):
        first = make(dp=dp_before, rank=rank, lb=G // dp_before)
        for _ in range(3):
            first.next_step()
        states.append(json.loads(json.dumps(first.state_dict())))  # survives a plain serialization
    assert all(s == states[0] for s in states), "a finite mixture's state is the same on every rank"
    assert sum(states[0]["drawn"]) == states[0]["samples_consumed"] == 3 * G
    resumed = global_batches(make, 3, dp=dp_after, lb=lb_after, state=states[0])
    for want, got in zip(uninterrupted[3:], resumed, strict=True):
        assert torch.equal(want, got)


def test_tokens_by_source_counts_the_global_draws(corpora, tok):
    rank1 = make_loader(mixture(corpora), tok, dp=2, rank=1, lb=4)
    for _ in range(5):
        rank1.next_step()
    chosen = np.bincount(MixtureSampler([0.7, 0.3], seed=0).choose(np.arange(5 * G)), minlength=2)
    assert rank1.tokens_by_source() == {str(corpora[0]): chosen[0] * SEQ_LEN, str(corpora[1]): chosen[1] * SEQ_LEN}
    single = make_loader(load_documents("local", str(corpora[0])), tok)
    single.next_step()
    assert single.tokens_by_source() == {str(corpora[0]): G * SEQ_LEN}


def test_changed_weights_refuse_the_saved_state(corpora, tok):
    state = make_loader(mixture(corpora), tok).state_dict()
    with pytest.raises(DataError, match="different data setup: dataset '0.7 x local:"):
        make_loader(mixture(corpora, (0.5, 0.5)), tok).load_state_dict(state)
    with pytest.raises(DataError, match="different data setup"):
        make_loader(load_documents("local", str(corpora[0])), tok).load_state_dict(state)


def test_single_dataset_state_keeps_its_format(corpora, tok):
    """A run without a mixture saves what it always saved: older checkpoints still resume."""
    loader = make_loader(load_documents("local", str(corpora[0])), tok)
    loader.next_step()
    state = loader.state_dict()
    assert set(state) == {"samples_consumed", "fingerprint"}
    assert set(state["fingerprint"]) == {"dataset", "tokenizer", "seq_len", "seed"}


# ---- the config: [[training.datasets]] ----------------------------------------------


def recipe(tmp_path, text: str) -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return path


MIXTURE_TOML = """
[[training.datasets]]
name = "bundled"
weight = 0.7

[[training.datasets]]
path = "data/code"
weight = 0.3

[[training.datasets]]
name = "hf:allenai/c4"
config = "en"
split = "validation"
text_field = "content"
weight = 1
"""


def test_recipe_tables_become_typed_entries_and_round_trip(tmp_path):
    cfg = load_config(recipe(tmp_path, MIXTURE_TOML))
    names = [(e.name, e.path, e.weight, e.config, e.split, e.text_field) for e in cfg.training.datasets]
    assert names == [
        ("bundled", "", 0.7, "", "train", "text"),
        ("", "data/code", 0.3, "", "train", "text"),
        ("hf:allenai/c4", "", 1.0, "en", "validation", "content"),
    ]
    assert [e.label for e in cfg.training.datasets] == ["bundled", "data/code", "hf:allenai/c4"]
    again = recipe(tmp_path, to_toml(cfg))
    assert load_config(again) == cfg


def test_command_line_takes_an_inline_array_or_clears_the_mixture(tmp_path):
    cfg = load_config(None, ["--training.datasets", '[{name = "bundled", weight = 2}, {path = "x.jsonl"}]'])
    assert [(e.label, e.weight) for e in cfg.training.datasets] == [("bundled", 2.0), ("x.jsonl", 1.0)]
    cleared = load_config(recipe(tmp_path, MIXTURE_TOML), ["--training.datasets", ""])
    assert cleared.training.datasets == []


@pytest.mark.parametrize(
    "table, message",
    [
        ('{nmae = "bundled"}', r"unknown key 'nmae' in training.datasets\[0\]; did you mean 'name'\?"),
        ('{name = "bundled", path = "x"}', r"training.datasets\[0\] needs exactly one of name .* got both"),
        ("{weight = 2.0}", r"training.datasets\[0\] needs exactly one of name .* got neither"),
        ('{name = "bundled", weight = 0}', r"'training.datasets\[0\].weight' = 0.0 must be > 0"),
        ('{name = "bundled", weight = -1}', r"'training.datasets\[0\].weight' = -1.0 must be > 0"),
        ('{name = "bundled", weight = nan}', r"weight' = nan must be a finite number > 0"),
        ('{name = "bundled", weight = inf}', r"weight' = inf must be a finite number > 0"),
        ('{name = "bundled", weight = "heavy"}', r"weight' expects float, got 'heavy'"),
        ('{name = "bundled", split = "val"}', r"split applies only to hf: datasets, not to 'bundled'"),
        ('{name = "bundled"}, {name = "bundled"}', r"training.datasets\[1\]: 'bundled' is already in the mixture"),
    ],
)
def test_bad_tables_are_one_line_config_errors(tmp_path, table, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, ["--training.datasets", f"[{table}]"])
    assert "\n" not in str(err.value)
    as_toml = f"[training]\ndatasets = [{table}]\n"
    with pytest.raises(ConfigError, match=message):
        load_config(recipe(tmp_path, as_toml))


def test_mixture_with_a_single_dataset_key_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="replaces training.dataset and training.dataset_path"):
        load_config(recipe(tmp_path, MIXTURE_TOML), ["--training.dataset_path", "x.jsonl"])
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(None, ["--training.datasets", "[{name = 'bundled'"])
    with pytest.raises(ConfigError, match="expects a list of tables"):
        load_config(None, ["--training.datasets", "3"])


def test_sources_from_config_resolves_names_and_paths(tmp_path, corpora):
    cfg = load_config(None, ["--training.datasets", f'[{{name = "bundled"}}, {{path = "{corpora[1]}", weight = 3}}]'])
    sources = sources_from_config(cfg.training)
    assert [(s.label, s.source.name, s.weight) for s in sources] == [
        ("bundled", "bundled", 1.0), (str(corpora[1]), "local", 3.0),
    ]
    with pytest.raises(DataError, match="unknown dataset 'bundld'"):
        sources_from_config(load_config(None, ["--training.datasets", '[{name = "bundld"}]']).training)
    with pytest.raises(DataError, match="as path = FILE_OR_FOLDER, not name = 'local'"):
        sources_from_config(load_config(None, ["--training.datasets", '[{name = "local"}]']).training)
    single = sources_from_config(load_config(None, ["--training.dataset_path", str(corpora[0])]).training)
    assert [(s.label, s.weight) for s in single] == [(str(corpora[0]), 1.0)]

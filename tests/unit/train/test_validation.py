"""Validation while training (titanctl/train/validate.py), in one process: the loss is the mean token
cross-entropy over the held-out windows in file order, the same every evaluation, logged with its
perplexity; training does not notice it; bad setups fail before training in one line."""

from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from titanctl.config.recipe import load_config
from titanctl.data.dataloader import tokenize_finite
from titanctl.data.datasets import load_documents
from titanctl.errors import ConfigError, DataError
from titanctl.train.trainer import Trainer
from titanctl.train.validate import ValidationResult, ValidationSet

SEQ = 32
TINY = ["--model.n_layers", "2", "--training.seq_len", str(SEQ), "--training.global_batch_size", "4",
        "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32",
        "--lr_scheduler.warmup_steps", "1", "--activation_checkpoint.mode", "none", "--metrics.log_freq", "1"]
VALIDATION = ["--validation.enabled", "--validation.freq", "2", "--validation.steps", "3"]


def trainer(folder, *extra: str) -> Trainer:
    return Trainer(load_config(None, [*TINY, "--job.dump_folder", str(folder), *extra]))


def rows(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 5 steps without and with validation (every 2 steps and at the last, 3 batches)."""
    plain, validated = tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("validated")
    trainer(plain, "--training.steps", "5").train()
    t = trainer(validated, "--training.steps", "5", "--metrics.enable_tensorboard", *VALIDATION)
    t.train()
    return plain, validated, t


@pytest.mark.slow
def test_training_losses_are_bit_identical_with_validation(runs):
    plain, validated, _ = runs
    assert [r["loss"] for r in rows(validated)] == [r["loss"] for r in rows(plain)]
    assert [r["grad_norm"] for r in rows(validated)] == [r["grad_norm"] for r in rows(plain)]


@pytest.mark.slow
def test_validation_rows_console_and_tensorboard(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, validated, _ = runs
    data = rows(validated)
    assert [r["step"] for r in data] == [1, 2, 3, 4, 5]  # every row keeps its training loss
    checked = [r for r in data if "val_loss" in r]
    assert [r["step"] for r in checked] == [2, 4, 5]  # every freq steps and at the last
    for r in checked:
        assert r["val_perplexity"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-12)
    assert checked[0]["val_loss"] > checked[-1]["val_loss"]  # the model learns (lr > 0 at steps 2-4)
    acc = EventAccumulator(str(validated / "tb"))
    acc.Reload()
    for key in ("loss", "perplexity"):
        events = acc.Scalars(f"validation/{key}")
        assert [e.step for e in events] == [2, 4, 5]
        for event, row in zip(events, checked):
            assert event.value == pytest.approx(row[f"val_{key}"], rel=1e-6)
    assert "train/val_loss" not in acc.Tags()["scalars"] and "train/loss" in acc.Tags()["scalars"]


@pytest.mark.slow
def test_an_evaluation_is_the_mean_loss_over_the_first_windows_in_file_order(runs):
    """Computed by hand from the bundled_val tokens and the trained model; twice the same; and running
    it leaves the RNG, the training loader and the modules' mode as they were."""
    _, _, t = runs
    model = t.model_parts[0]
    tokens = tokenize_finite(load_documents("bundled_val"), t.tokenizer)
    n = 3 * 4  # validation.steps x global batch
    windows = torch.from_numpy(np.array(tokens[: n * (SEQ + 1)], dtype=np.int64)).view(n, SEQ + 1)
    with torch.no_grad():
        logits = model(windows[:, :-1])  # (n, SEQ, vocab)
        expected = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()

    rng, loader_state, modes = torch.get_rng_state(), t.loader.state_dict(), [m.training for m in model.modules()]
    first, second = t.validator.run(t.step), t.validator.run(t.step)
    assert first.loss == second.loss
    assert first.loss == pytest.approx(expected, rel=1e-6)
    assert (first.batches, first.tokens) == (3, n * SEQ)
    assert torch.equal(torch.get_rng_state(), rng)
    assert t.loader.state_dict() == loader_state
    assert [m.training for m in model.modules()] == modes


def test_batches_are_cut_like_training_batches_under_any_data_parallel_degree():
    """The union over data-parallel ranks and microbatches of batch b is windows [b*G, (b+1)*G)
    in order, whatever the degree and local batch: the validation loss cannot depend on the layout."""
    seq, G = 3, 8
    tokens = np.arange(10 * G * (seq + 1), dtype=np.int32)
    whole = tokens.reshape(-1, seq + 1)
    for dp, lb in ((1, 8), (1, 2), (2, 4), (4, 1), (2, 2)):
        for b in (0, 3):
            seen = []
            for rank in range(dp):
                data = ValidationSet(tokens, "test", seq_len=seq, global_batch_size=G, local_batch_size=lb,
                                     dp_rank=rank, dp_degree=dp, steps=-1)
                assert data.batches == 10
                for m, (inputs, labels) in enumerate(data.batch(b)):
                    assert inputs.shape == labels.shape == (lb, seq) and inputs.dtype == torch.int64
                    assert torch.equal(inputs[:, 1:], labels[:, :-1])
                    seen += [(m, rank, row[0].item()) for row in inputs]
            starts = [first for _, _, first in sorted(seen)]
            assert starts == list(whole[b * G:(b + 1) * G, 0]), (dp, lb)


def test_perplexity_is_exp_of_the_loss():
    r = ValidationResult(step=3, loss=2.5, batches=1, tokens=64, seconds=0.1)
    assert r.perplexity == math.exp(2.5) and r.metrics() == {"val_loss": 2.5, "val_perplexity": math.exp(2.5)}
    assert ValidationResult(3, 1000.0, 1, 64, 0.1).perplexity == math.inf  # no OverflowError mid-run
    assert "\n" not in r.describe() and "loss 2.5000" in r.describe() and "perplexity 12.18" in r.describe()


def test_step_count_errors_are_one_line():
    tokens = np.zeros(5 * 8 * 4, dtype=np.int32)  # 40 windows of 3 + 1 tokens: 5 batches of 8
    kwargs = dict(seq_len=3, global_batch_size=8, local_batch_size=4, dp_rank=0, dp_degree=1)
    with pytest.raises(DataError, match=r"'validation.steps' = 6 asks for more batches .* make 5 batches "
                                        r"of 8; set validation.steps to at most 5, or -1 for all"):
        ValidationSet(tokens, "x", steps=6, **kwargs)
    with pytest.raises(ConfigError, match=r"'validation.steps' = 0 must be -1 \(the whole validation set\) or >= 1"):
        ValidationSet(tokens, "x", steps=0, **kwargs)
    assert ValidationSet(tokens, "x", steps=5, **kwargs).batches == 5


def _small_file(tmp_path) -> str:
    path = tmp_path / "tiny.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"text": "Too short to fill one batch."}) + "\n")
    return str(path)


@pytest.mark.slow
def test_a_validation_set_smaller_than_a_batch_fails_before_training(tmp_path):
    path = _small_file(tmp_path)
    with pytest.raises(DataError) as e:
        trainer(tmp_path / "run", "--validation.enabled", "--validation.dataset_path", path)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"validation dataset {path} has ")
    assert "fewer than one validation batch (the global batch) of 4" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_streaming_validation_dataset_is_refused(tmp_path):
    folder = tmp_path / "hub_like"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "train.jsonl").write_text(json.dumps({"text": "a b c"}) + "\n")
    with pytest.raises(ConfigError, match=r"'validation.dataset' = 'hf:.*' streams; .* bundled_val, bundled, or local"):
        trainer(tmp_path / "run", "--validation.enabled", "--validation.dataset", f"hf:{folder}")


@pytest.mark.slow
def test_validation_off_reads_no_validation_data(tmp_path):
    """With validation.enabled false the other keys do nothing: a missing path is no error."""
    t = trainer(tmp_path / "run", "--validation.dataset_path", str(tmp_path / "missing"))
    assert t.validator is None
    t.close()


@pytest.mark.parametrize("overrides, message", [
    (["--validation.dataset", "local"], "'validation.dataset' = 'local' needs validation.dataset_path=FILE_OR_FOLDER"),
    (["--validation.dataset", "c4", "--validation.dataset_path", "x.jsonl"],
     "'validation.dataset_path' = 'x.jsonl' reads local files, but validation.dataset = 'c4'; unset one of them"),
])
@pytest.mark.slow
def test_dataset_and_path_that_disagree_are_refused(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:
        trainer(tmp_path / "run", "--validation.enabled", *overrides)
    assert message in str(e.value) and "\n" not in str(e.value)

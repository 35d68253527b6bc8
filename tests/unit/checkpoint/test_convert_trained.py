"""Trained weights (not random ones) survive every format: the same held-out loss after a round trip,
and transformers computes that loss too. Last: training starts from a converted checkpoint."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from tests.cli_server import titanctl_run
from tests.conftest import OFFLINE_ENV, REPO
from tests.unit.trained_model import N_LAYERS, SEQ, loss_of
from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint
from titanctl.data.datasets import load_documents
from titanctl.data.tokenizer import Tokenizer
from titanctl.models.common.decoder import Transformer


@pytest.fixture(scope="module")
def trained(trained_debug):
    return trained_debug


def model_from(folder) -> Transformer:
    sd, args = load_checkpoint(folder)
    with torch.device("meta"):  # no init work: every weight comes from the checkpoint
        model = Transformer(args.replace(max_seq_len=SEQ))
    model.load_state_dict(sd, strict=True, assign=True)
    model.init_buffers("cpu")
    return model.eval()


@pytest.mark.parametrize("fmt", ["meta", "hf", "torchtune"])
@pytest.mark.slow
def test_trained_weights_keep_their_loss_through_every_format(trained, tmp_path, fmt):
    convert_checkpoint(trained["folder"], tmp_path / fmt, dst_format=fmt)
    convert_checkpoint(tmp_path / fmt, tmp_path / "back", dst_format="dcp")
    for folder in (tmp_path / fmt, tmp_path / "back"):
        model = model_from(folder)
        for name, tensor in trained["state"].items():
            assert torch.equal(model.state_dict()[name], tensor), name
        assert loss_of(model, trained["held_out"]) == trained["loss"]


def test_transformers_computes_the_same_held_out_loss(trained, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    import transformers
    convert_checkpoint(trained["folder"], tmp_path / "hf")  # dcp -> hf by default
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (4096, 4097)  # the bundled tokenizer's ids
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    loss = loss_of(theirs, trained["held_out"])
    assert loss == pytest.approx(trained["loss"], rel=1e-5), (loss, trained["loss"])


def _first_batch_of_the_trainer(seq_len: int, batch: int) -> torch.Tensor:
    """The trainer's first (inputs, labels) batch of the debug recipe, from the same loader."""
    from titanctl.data.dataloader import TokenWindowLoader

    loader = TokenWindowLoader(
        load_documents("bundled", None), Tokenizer(), seq_len=seq_len, global_batch_size=batch,
        local_batch_size=batch, dp_rank=0, dp_degree=1, seed=0,
    )
    (microbatch,) = loader.next_step()
    return microbatch


def test_training_starts_from_a_converted_checkpoint(trained, tmp_path, monkeypatch):
    """Meta weights brought in as a user would: meta -> dcp, train with initial_load_path; step 1's
    loss equals what transformers computes on the same batch with the HF export of the same weights."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    import transformers
    convert_checkpoint(trained["folder"], tmp_path / "meta", dst_format="meta")  # "Meta's download"
    convert_checkpoint(tmp_path / "meta", tmp_path / "imported", dst_format="dcp")
    convert_checkpoint(tmp_path / "meta", tmp_path / "hf", dst_format="hf")
    out = tmp_path / "run"
    proc = titanctl_run(["train", "--config", str(REPO / "recipes" / "llama3_debug.toml"), "--training.steps", "1",
         "--training.seq_len", str(SEQ), "--training.local_batch_size", "4", "--model.n_layers", str(N_LAYERS), "--job.dump_folder", str(out),
         "--checkpoint.enable_checkpoint", "--checkpoint.initial_load_path", str(tmp_path / "imported"),
         "--metrics.enable_tensorboard", "false", "--compile.enable", "false"], env={**os.environ, **OFFLINE_ENV}, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    step1 = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert step1["step"] == 1
    inputs, labels = _first_batch_of_the_trainer(SEQ, 4)
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = theirs(inputs).logits
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
    assert step1["loss"] == pytest.approx(want, rel=1e-4), (step1["loss"], want)

"""Qwen3 checkpoints through every format Qwen3 has, and out of a training run.

A folder that transformers' ``save_pretrained`` wrote (tiny random config, tied and untied) goes
Hugging Face -> torchtitan -> Hugging Face (-> DCP -> Hugging Face: the conformance suite): the safetensors
come back bit for bit, config.json says the same model, and transformers' logits are unchanged.
Formats that cannot hold Qwen3 are one-line errors. A few steps of `titanctl train` exported with
`titanctl convert --to hf` load in transformers with titanctl's logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.unit.hf_reference import tokens
from tests.unit.models.families import qwen3_model
from tests.unit.models.test_qwen3_parity import ARGS
from titanctl.checkpoint.convert import convert_checkpoint, open_checkpoint
from titanctl.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# config.json keys that describe the model (not dtype, token ids, transformers' version, ...)
MODEL_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "tie_word_embeddings", "rope_theta", "rms_norm_eps", "vocab_size")
TIED = [False, True]


@pytest.fixture(scope="module")
def transformers():
    import transformers  # offline: tests/conftest.py sets HF_HUB_OFFLINE etc. and a temporary HF_HOME

    return transformers


@pytest.fixture(scope="module", params=TIED, ids=["untied", "tied"])
def hf_folder(request, transformers, tmp_path_factory):
    """(folder written by save_pretrained, the model it holds)."""
    model = qwen3_model(ARGS.replace(tie_embeddings=request.param))
    folder = tmp_path_factory.mktemp("qwen3_hf") / "hf"
    model.save_pretrained(folder)
    return folder, model


def safetensors_of(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def rope_theta(config: dict) -> float:
    """transformers 5.x writes it inside rope_parameters only."""
    return config.get("rope_theta") or config["rope_parameters"]["rope_theta"]


def model_config(folder: Path) -> dict:
    config = json.loads((folder / "config.json").read_text())
    return {key: rope_theta(config) if key == "rope_theta" else config.get(key) for key in MODEL_KEYS}


@torch.no_grad()
def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def assert_same_hf_checkpoint(transformers, original: Path, model, back: Path) -> None:
    first, last = safetensors_of(original), safetensors_of(back)
    assert first.keys() == last.keys()  # a tied model: no lm_head.weight either time
    for name, tensor in first.items():
        assert last[name].dtype == tensor.dtype and torch.equal(last[name], tensor), name
    assert model_config(back) == model_config(original)
    loaded = transformers.Qwen3ForCausalLM.from_pretrained(back).eval()
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == model.config.tie_word_embeddings
    ids = tokens(ARGS.vocab_size)
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(model, ids), rtol=0, atol=0)


def test_hf_torchtitan_hf_is_bit_identical(transformers, hf_folder, tmp_path):
    import torch.distributed.checkpoint as dcp

    folder, model = hf_folder
    tied = model.config.tie_word_embeddings
    convert_checkpoint(folder, tmp_path / "tt", dst_format="torchtitan")
    # torchtitan 0.3's Qwen3 names (test_torchtitan_format has them all); its loader wants the output layer
    # also when tied.
    stored = dcp.FileSystemReader(str(tmp_path / "tt")).read_metadata().state_dict_metadata
    assert {"layers.0.attention.qkv_linear.wq.weight", "layers.0.attention.q_norm.weight", "lm_head.weight"} <= set(stored)
    assert not (tmp_path / "tt" / "params.json").exists()  # Meta's keys cannot describe Qwen3
    with open_checkpoint(tmp_path / "tt") as source:
        assert source.format == "torchtitan" and source.origin == "config.json"
        assert source.args.family == "qwen3" and source.args.tie_embeddings == tied
        assert source.args.replace(max_seq_len=ARGS.max_seq_len) == ARGS.replace(tie_embeddings=tied)
    convert_checkpoint(tmp_path / "tt", tmp_path / "back", dst_format="hf")
    assert_same_hf_checkpoint(transformers, folder, model, tmp_path / "back")


@pytest.mark.parametrize("fmt", ["meta", "torchtune"])
def test_formats_without_qwen3_are_one_line_errors(hf_folder, tmp_path, fmt):
    folder, _ = hf_folder
    with pytest.raises(CheckpointError) as e:
        convert_checkpoint(folder, tmp_path / "out", dst_format=fmt)
    message = str(e.value)
    assert message == f"qwen3 has no {fmt} checkpoint format; write one of dcp, hf, torchtitan"
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


# ----------------------------------------------------------------------------- out of a training run

TRAIN = [
    "--model.name", "qwen3",
    "--model.flavor", "debugmodel",
    "--model.n_layers", "2",
    "--training.seq_len", "32",
    "--training.global_batch_size", "4",
    "--training.local_batch_size", "4",
    "--training.steps", "3",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "1",
    "--activation_checkpoint.mode", "none",
    "--checkpoint.enable_checkpoint",
    "--checkpoint.interval", "3",
]


def test_trained_qwen3_exports_to_transformers(transformers, tmp_path):
    from titanctl.checkpoint.run.load_into_model import load_source_into
    from titanctl.cli.app import main
    from titanctl.config.recipe import load_config
    from titanctl.models.common.decoder import Transformer
    from titanctl.train.trainer import Trainer

    Trainer(load_config(None, [*TRAIN, "--job.dump_folder", str(tmp_path / "run")])).train()
    step = tmp_path / "run" / "checkpoint" / "step-3"
    with pytest.raises(SystemExit) as exit_:
        main(["convert", str(step), str(tmp_path / "hf"), "--to", "hf"])
    assert exit_.value.code in (0, None)
    with open_checkpoint(step) as source:
        assert source.args.family == "qwen3" and source.args.tie_embeddings
        ours = Transformer(source.args)
        load_source_into(ours, source)
    ours.eval()
    theirs = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert theirs.lm_head.weight is theirs.model.embed_tokens.weight  # tied on both sides
    assert model_config(tmp_path / "hf")["num_hidden_layers"] == 2
    ids = tokens(source.args.vocab_size)[:, :32]
    logits = logits_of(ours, ids)
    delta = (logits - logits_of(theirs, ids)).abs().max().item()
    print(f"\nQWEN3 trained -> hf: max |logit| {logits.abs().max().item():.2f}, max |Δlogit| {delta:.2e}")
    assert delta <= 1e-4, f"max |Δlogit| = {delta:.3g}"

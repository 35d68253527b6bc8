"""`train --checkpoint.initial_load_path` takes a Hugging Face or torchtitan folder directly: converted
on the fly, the first step equals the one that starts from the converted titanctl checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.distributed.harness import CLI, losses, max_rel_diff, torchrun
from tests.unit.checkpoint.test_torchtitan_format import write_torchtitan
from tests.unit.trained_model import N_LAYERS, SEQ
from titanctl.checkpoint.convert import convert_checkpoint
from titanctl.config.recipe import load_config
from titanctl.data.tokenizer import Tokenizer
from titanctl.errors import CheckpointError, ConfigError
from titanctl.models.common.decoder import Transformer
from titanctl.models.llama.args import LLAMA3_FLAVORS
from titanctl.train.trainer import Trainer

RUN = [
    "--model.n_layers", str(N_LAYERS),
    "--training.seq_len", str(SEQ),
    "--training.local_batch_size", "4",
    "--training.steps", "2",
    "--training.mixed_precision_param", "float32",
    "--metrics.log_freq", "1",
    "--activation_checkpoint.mode", "none",
]


@pytest.fixture(scope="module")
def exports(trained_debug, tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    for fmt in ("hf", "torchtitan"):
        convert_checkpoint(trained_debug["folder"], root / fmt, dst_format=fmt)
    return {"dcp": trained_debug["folder"], **{fmt: root / fmt for fmt in ("hf", "torchtitan")}}


def train(tmp_path, initial, *extra) -> list[dict]:
    out = tmp_path / "run"
    Trainer(load_config(None, [*RUN, "--job.dump_folder", str(out), "--checkpoint.initial_load_path", str(initial),
                               *extra])).train()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def from_dcp(exports, tmp_path_factory):
    return train(tmp_path_factory.mktemp("dcp"), exports["dcp"])


@pytest.mark.parametrize("fmt", ["hf", "torchtitan"])
@pytest.mark.slow
def test_foreign_initial_checkpoint_trains_like_the_converted_one(exports, from_dcp, tmp_path, fmt, capsys):
    rows = train(tmp_path, exports[fmt])
    assert [(r["loss"], r["grad_norm"]) for r in rows] == [(r["loss"], r["grad_norm"]) for r in from_dcp]
    assert "converted on the fly" in capsys.readouterr().out
    assert not any(p.name.startswith("step-") for p in (tmp_path / "run").rglob("*")), "nothing converted on disk"


@pytest.mark.slow
def test_a_torchtitan_full_training_checkpoint_gives_its_weights_only(trained_debug, from_dcp, tmp_path, capsys):
    """Written as torchtitan 0.3 writes a training step (optimizer, lr_scheduler, dataloader, train_state
    beside the model, no titanctl.json or params.json): the model shape comes from the tensors, the
    other entries are ignored with a note, and the first step equals the converted checkpoint's."""
    step = tmp_path / "step-7"
    write_torchtitan(step, trained_debug["state"], full=True)
    rows = train(tmp_path, step)
    assert [r["loss"] for r in rows] == [r["loss"] for r in from_dcp]
    assert "optimizer" in capsys.readouterr().out  # "... model weights taken; dataloader, lr_scheduler, ... ignored"


def test_a_foreign_checkpoint_of_another_model_is_refused_before_training(exports, tmp_path):
    with pytest.raises(CheckpointError, match=r"lacks tensor\(s\) layers\.2\..* that the model from this run's recipe has"):
        train(tmp_path, exports["hf"], "--model.n_layers", "3")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_same_shapes_but_another_rope_is_refused(exports, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(exports["hf"], hf)
    config = json.loads((hf / "config.json").read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"] = 10000.0
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json has rope_theta = 10000.0, but this run's model has 500000.0"):
        train(tmp_path, hf)


def test_weights_only_is_the_only_way_to_take_a_foreign_checkpoint(exports, tmp_path):
    with pytest.raises(ConfigError, match="initial_load_model_weights_only = true"):
        train(tmp_path, exports["hf"], "--checkpoint.initial_load_model_weights_only", "false")


def test_fsdp_ranks_each_slice_the_hf_weights_they_hold(exports, from_dcp, tmp_path):
    torchrun(2, [*CLI, "train"], [*RUN, "--training.local_batch_size", "2",
                                              "--checkpoint.initial_load_path", str(exports["hf"]),
                                              "--job.dump_folder", str(tmp_path)])
    assert max_rel_diff(losses(tmp_path), [r["loss"] for r in from_dcp]) <= 1e-5


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.slow
def test_torchtitans_multi_head_debugmodel_trains_with_its_flavor(tmp_path):
    """torchtitan's debugmodel has 16 heads of 16, all key/value, titanctl's debugmodel 8 of 32 with 2 key/value:
    `--model.flavor debugmodel_torchtitan` makes the run's model torchtitan's, and its first steps equal those
    from the converted checkpoint."""
    args = LLAMA3_FLAVORS["debugmodel_torchtitan"].replace(n_layers=N_LAYERS, vocab_size=Tokenizer().vocab_size)
    torch.manual_seed(0)
    step = tmp_path / "step-5"
    write_torchtitan(step, Transformer(args).state_dict(), full=True)
    with pytest.raises(CheckpointError, match=r"flavor debugmodel_torchtitan's key/value width \(16 heads of 16\)"):
        train(tmp_path / "refused", step)
    convert_checkpoint(step, tmp_path / "dcp")
    direct = train(tmp_path / "direct", step, "--model.flavor", "debugmodel_torchtitan")
    converted = train(tmp_path / "converted", tmp_path / "dcp", "--model.flavor", "debugmodel_torchtitan")
    assert [(r["loss"], r["grad_norm"]) for r in direct] == [(r["loss"], r["grad_norm"]) for r in converted]
    meta = json.loads((tmp_path / "dcp" / "titanctl.json").read_text())
    assert meta["model_args"]["n_kv_heads"] == 16

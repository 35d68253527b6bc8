"""Hostile input round 4 (issue 57) through the titanctl binary: one case of each class that reaches the
command line as a user types it. Each ends in one red line and exit code 2, no traceback, within seconds,
and nothing is written but a dump folder's lock (the refusal comes before a step). The classes' many other
cases run in-process: test_hostile_{data_files,templates}.py in tests/unit/data, test_hostile_values.py in
tests/unit/config, test_hostile_config_json.py, test_checksum_manifest.py and test_lora_export.py in
tests/unit/checkpoint, test_ft_inprocess.py in tests/unit/parallel."""

from __future__ import annotations

import json
import os

from tests.cli.test_unfinishable_values import refused
from tests.conftest import TRUSTED_RUN
from tests.unit.checkpoint.test_lora_checkpoints import LORA_RUN


def test_chat_data_that_is_a_fifo(tmp_path):
    fifo = tmp_path / "chat.jsonl"
    os.mkfifo(fifo)
    err = refused("train", *TRUSTED_RUN, "--training.dataset", f"chat:{fifo}", "--model.attn_mask_type",
                  "block_causal", "--job.dump_folder", str(tmp_path / "run"))
    assert err.strip() == f"error: chat dataset file {fifo} is not a regular file"
    assert not (tmp_path / "run" / "checkpoint").exists()


def test_a_backtracking_regex_on_the_command_line(tmp_path):
    err = refused("train", "--optimizer.groups", '[{params = "(.*.*)*!"}]', "--job.dump_folder", str(tmp_path / "r"))
    assert "config key 'optimizer.groups[0].params' = '(.*.*)*!' repeats a part that holds a repeat" in err
    assert not (tmp_path / "r").exists()


def test_numbers_past_what_training_can_use(tmp_path):
    assert "past float32's largest value" in refused("train", "--optimizer.lr", "1e308")
    assert "'optimizer.muon_ns_steps' = 1000000000 must be in [1, 100]" in refused(
        "train", "--optimizer.name", "Muon", "--optimizer.muon_ns_steps", "1000000000")


def test_a_lora_rank_past_the_models_width(trained_run, tmp_path):
    """--lora.rank 65536 on the dim-256 debug model: refused naming the layer, before any adapter exists."""
    err = refused("train", *LORA_RUN, "--checkpoint.initial_load_path", str(trained_run / "checkpoint" / "step-2"),
                  "--lora.rank", "65536", "--job.dump_folder", str(tmp_path / "run"))
    assert "config key 'lora.rank' = 65536 exceeds min(in, out) = 64 of target layers.0.attention.wk" in err


def test_an_edited_titanctl_json(trained_run, tmp_path):
    import shutil

    step = tmp_path / "step-2"
    shutil.copytree(trained_run / "checkpoint" / "step-2", step)
    meta = json.loads((step / "titanctl.json").read_text())
    meta["model_args"]["n_layers"] = 10**9
    (step / "titanctl.json").unlink()
    (step / "titanctl.json").write_text(json.dumps(meta))
    err = refused("convert", str(step), str(tmp_path / "out"), "--to", "hf")
    assert "titanctl.json: its fields do not match the sha256 checksum recorded when the checkpoint was saved" in err
    assert not (tmp_path / "out").exists()


def test_escape_bytes_in_torchft_lighthouse(tmp_path):
    """The address was printed raw (the escape sequences obeyed); torchrun's variables as a replica group's."""
    env_line = refused("train", "--fault_tolerance.enable", "--fault_tolerance.lighthouse_address",
                       "http://\x1b[31mred:29510", "--job.dump_folder", str(tmp_path / "run"))
    assert "\x1b" not in env_line and "\\x1b[31mred" in env_line and "holds control characters" in env_line

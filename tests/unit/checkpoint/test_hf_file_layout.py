"""HF -> DCP -> HF gives back the source's files: a `model.safetensors` as `model.safetensors` (no index),
four shards as the same four with their index; a model that came from no HF folder is written as
save_pretrained writes it (one `model.safetensors` without index when it fits one shard, else
`model-0000i-of-0000N.safetensors` and the index); --max-shard-size asks for new shards."""

from __future__ import annotations

import json

import pytest
import torch

from titanctl.checkpoint.convert import convert_checkpoint, save_state_dict
from titanctl.models.qwen3.args import qwen3_args

ARGS = qwen3_args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=128, tied=False, head_dim=32, vocab_size=300)


@pytest.fixture(scope="module")
def theirs():
    import transformers

    from titanctl.checkpoint.hf.names import hf_config

    torch.manual_seed(0)
    config = transformers.Qwen3Config(**hf_config(ARGS.replace(max_seq_len=64)))
    return transformers.Qwen3ForCausalLM(config).eval()


def files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("model"))


@pytest.mark.parametrize("max_shard_size", [None, "100KB"], ids=["one file", "shards"])
def test_an_hf_folder_comes_back_in_its_own_files(theirs, tmp_path, max_shard_size):
    theirs.save_pretrained(tmp_path / "hf", **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    convert_checkpoint(tmp_path / "hf", tmp_path / "dcp", dst_format="dcp")
    convert_checkpoint(tmp_path / "dcp", tmp_path / "back", dst_format="hf")
    assert files(tmp_path / "back") == files(tmp_path / "hf")
    if max_shard_size is None:
        assert files(tmp_path / "hf") == ["model.safetensors"]
    else:
        assert len(files(tmp_path / "hf")) > 3  # shards and their index
        theirs_map, ours_map = (json.loads((f / "model.safetensors.index.json").read_text())["weight_map"]
                                for f in (tmp_path / "hf", tmp_path / "back"))
        assert ours_map == theirs_map


def test_a_model_from_no_hf_folder_is_written_as_save_pretrained_writes_it(theirs, tmp_path):
    save_state_dict(theirs_state(theirs), ARGS, tmp_path / "dcp")
    convert_checkpoint(tmp_path / "dcp", tmp_path / "one", dst_format="hf")
    assert files(tmp_path / "one") == ["model.safetensors"]
    convert_checkpoint(tmp_path / "dcp", tmp_path / "many", dst_format="hf", max_shard_size="100KB")
    found = files(tmp_path / "many")
    count = len(found) - 1
    assert found == [*(f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)),
                     "model.safetensors.index.json"] and count > 1


def theirs_state(theirs) -> dict[str, torch.Tensor]:
    from titanctl.checkpoint.hf.names import from_hf_state_dict

    return from_hf_state_dict(theirs.state_dict(), ARGS)


def test_a_run_that_started_from_an_hf_folder_saves_and_exports_into_its_files(foreign_formats, tmp_path):
    """The run's steps carry the source's files (hf_files in titanctl.json) as they carry its config.json: its
    Hugging Face save and `convert --to hf` of its step write them (here: 2MB shards and their index)."""
    from tests.conftest import TRUSTED_RUN
    from titanctl.checkpoint.formats.hf import HFSource
    from titanctl.checkpoint.hf.names import HF_FILES_KEY
    from titanctl.checkpoint.trust.metadata import read_metadata
    from titanctl.config.recipe import load_config
    from titanctl.train.trainer import Trainer

    source = foreign_formats["hf"]
    Trainer(load_config(None, [*TRUSTED_RUN, "--training.steps", "1", "--checkpoint.last_save_in_hf",
                               "--checkpoint.initial_load_path", str(source),
                               "--checkpoint.initial_load_model_weights_only", "--job.dump_folder",
                               str(tmp_path / "run")])).train()
    root = tmp_path / "run" / "checkpoint"
    assert read_metadata(root / "step-1")[HF_FILES_KEY] == HFSource(source).extra_metadata()[HF_FILES_KEY]
    convert_checkpoint(root / "step-1", tmp_path / "exported", dst_format="hf")
    assert len(files(source)) > 2 and files(root / "step-1-hf") == files(tmp_path / "exported") == files(source)

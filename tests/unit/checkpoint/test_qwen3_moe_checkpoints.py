"""Qwen3-MoE checkpoints: a folder that transformers 5.23's save_pretrained wrote (one tensor per expert,
the Hub's layout) converts HF -> DCP -> HF bit for bit and transformers loads the export (the conformance
suite); in bf16 too; a folder of transformers 5's
packed experts (gate_up_proj [E, 2F, D], as its model holds them) reads to the same weights and exports in
the Hub's layout; a folder holding both layouts is a one-line refusal; the expert bias, which Hugging Face
does not store, reads as zeros and is not written."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from safetensors.torch import save_file

from tests.unit.checkpoint.test_qwen3_checkpoints import safetensors_of
from tests.unit.hf_reference import assert_round_trip_keeps_the_folder, per_expert_layout
from tests.unit.models.test_moe_layer import ARGS, theirs  # noqa: F401 - the module fixture
from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint
from titanctl.checkpoint.hf.names import from_hf_state_dict, to_hf_state_dict
from titanctl.errors import CheckpointError

TOL = 1e-4


def packed_folder(model, folder):
    """The model's own (packed) state dict as a Hugging Face folder."""
    folder.mkdir()
    model.config.to_json_file(folder / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_a_bf16_folder_exports_as_bf16(theirs, tmp_path):  # noqa: F811
    """The expert bias, which the folder lacks, reads as float32 zeros: the export's dtype is its tensors'."""
    copy.deepcopy(theirs).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "dcp", dst_format="dcp")
    convert_checkpoint(tmp_path / "dcp", tmp_path / "back", dst_format="hf")
    config = assert_round_trip_keeps_the_folder(tmp_path / "hf", tmp_path / "back")
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"


def test_packed_and_per_expert_folders_read_to_the_same_weights(theirs, tmp_path):  # noqa: F811
    theirs.save_pretrained(tmp_path / "saved")
    packed_folder(theirs, tmp_path / "packed")
    new, _ = load_checkpoint(tmp_path / "packed")
    old, _ = load_checkpoint(tmp_path / "saved")
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
    # The in-memory conversions agree with the folder ones, both ways, in the layout save_pretrained writes.
    per_expert = per_expert_layout(theirs.state_dict(), ARGS.moe.hidden_dim)
    assert all(torch.equal(from_hf_state_dict(per_expert, ARGS)[k], new[k]) for k in new)
    back = to_hf_state_dict(new, ARGS)
    saved = safetensors_of(tmp_path / "saved")
    assert back.keys() == saved.keys() and all(torch.equal(back[k], saved[k]) for k in saved)


def test_a_packed_folder_exports_in_the_layout_transformers_saves(theirs, tmp_path):  # noqa: F811
    theirs.save_pretrained(tmp_path / "saved")
    packed_folder(theirs, tmp_path / "packed")
    convert_checkpoint(tmp_path / "packed", tmp_path / "dcp", dst_format="dcp")
    convert_checkpoint(tmp_path / "dcp", tmp_path / "out", dst_format="hf", max_shard_size="100KB")
    saved, written = safetensors_of(tmp_path / "saved"), safetensors_of(tmp_path / "out")
    assert not any(name.endswith(("gate_up_proj", "experts.down_proj")) for name in written)
    assert saved.keys() == written.keys() and all(torch.equal(saved[k], written[k]) for k in saved)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # the experts of one layer spread over shards
    assert index["metadata"] == {"total_parameters": sum(p.numel() for p in theirs.parameters()),
                                 "total_size": sum(t.nbytes for t in saved.values())}


def test_a_folder_holding_both_expert_layouts_is_refused(theirs, tmp_path):  # noqa: F811
    theirs.save_pretrained(tmp_path / "both")
    packed = {k: v.contiguous() for k, v in theirs.state_dict().items() if k.startswith("model.layers.1.mlp.experts.")}
    assert packed.keys() == {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"}
    save_file(packed, str(tmp_path / "both" / "packed.safetensors"))  # beside model.safetensors, no index
    message = re.escape("layer 1 stores its experts in two layouts, packed ('model.layers.1.mlp.experts.")
    with pytest.raises(CheckpointError, match=message + r".*and one tensor per expert \('model.layers.1.mlp.experts.0"):
        convert_checkpoint(tmp_path / "both", tmp_path / "out", dst_format="dcp")
    assert not (tmp_path / "out").exists()
    mixed = {**per_expert_layout(theirs.state_dict(), ARGS.moe.hidden_dim), **packed}
    with pytest.raises(CheckpointError, match=message):
        from_hf_state_dict(mixed, ARGS)

"""Qwen3-MoE checkpoints: a folder with transformers 5's packed experts (gate_up_proj [E, 2F, D], as its
model holds them) converts HF -> DCP -> HF bit for bit, gives transformers' logits in titanctl, and
transformers loads titanctl's export; the one-tensor-per-expert layout (which transformers 5.23's
save_pretrained still writes) reads to the same weights; the expert bias, which Hugging Face does not
store, reads as zeros and is not written."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from tests.unit.hf_reference import per_expert_layout
from tests.unit.test_moe_layer import ARGS, theirs  # noqa: F401 - the module fixture
from tests.unit.test_qwen3_checkpoints import safetensors_of
from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint
from titanctl.checkpoint.hf_names import from_hf_state_dict, to_hf_state_dict
from titanctl.errors import CheckpointError
from titanctl.models.common.decoder import Transformer

TOL = 1e-4



def packed_folder(model, folder):
    """The model's own (packed) state dict as a Hugging Face folder."""
    folder.mkdir()
    model.config.to_json_file(folder / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_hf_to_dcp_to_hf_is_bit_identical_and_equals_transformers(theirs, tmp_path):  # noqa: F811
    import transformers

    packed_folder(theirs, tmp_path / "hf")
    assert "model.layers.0.mlp.experts.gate_up_proj" in safetensors_of(tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "dcp", dst_format="dcp")
    state, args = load_checkpoint(tmp_path / "dcp")
    assert args.family == "qwen3_moe" and args.moe == ARGS.moe
    assert not state["layers.0.moe.expert_bias"].any()
    convert_checkpoint(tmp_path / "dcp", tmp_path / "back", dst_format="hf")
    before, after = safetensors_of(tmp_path / "hf"), safetensors_of(tmp_path / "back")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["model_type"], config["num_experts"], config["num_experts_per_tok"]) == ("qwen3_moe", 8, 2)
    ours = Transformer(args.replace(max_seq_len=64))
    ours.load_state_dict(state, strict=True)
    reloaded = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = torch.randint(0, ARGS.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours.eval()(ids) - theirs(ids).logits).abs().max().item() <= TOL
        assert torch.equal(reloaded(ids).logits, theirs(ids).logits)


def test_per_expert_layout_reads_to_the_same_weights(theirs, tmp_path):  # noqa: F811
    theirs.save_pretrained(tmp_path / "saved")  # transformers 5.23 writes one tensor per expert
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in safetensors_of(tmp_path / "saved")
    packed_folder(theirs, tmp_path / "packed")
    per_expert = per_expert_layout(safetensors_of(tmp_path / "packed"), ARGS.moe.hidden_dim)
    (tmp_path / "old").mkdir()
    save_file(per_expert, str(tmp_path / "old" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "old" / "config.json").write_text((tmp_path / "packed" / "config.json").read_text())
    new, _ = load_checkpoint(tmp_path / "packed")
    for folder in ("old", "saved"):
        old, _ = load_checkpoint(tmp_path / folder)
        assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
    # The in-memory conversions agree with the folder ones, both ways.
    assert all(torch.equal(from_hf_state_dict(per_expert, ARGS)[k], new[k]) for k in new)
    back = to_hf_state_dict(new, ARGS)
    assert back.keys() == safetensors_of(tmp_path / "packed").keys()


def test_per_expert_layout_is_written_on_request_as_transformers_saves_it(theirs, tmp_path):  # noqa: F811
    import transformers

    theirs.save_pretrained(tmp_path / "saved")  # transformers 5.23's own one-tensor-per-expert files
    packed_folder(theirs, tmp_path / "packed")
    convert_checkpoint(tmp_path / "packed", tmp_path / "dcp", dst_format="dcp")
    convert_checkpoint(tmp_path / "dcp", tmp_path / "out", dst_format="hf", hf_experts="per-expert")
    saved, written = safetensors_of(tmp_path / "saved"), safetensors_of(tmp_path / "out")
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in written
    assert not any(name.endswith(("gate_up_proj", "experts.down_proj")) for name in written)
    assert saved.keys() == written.keys() and all(torch.equal(saved[k], written[k]) for k in saved)
    reloaded = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, ARGS.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, theirs(ids).logits)
    # And back: the per-expert folder converts to the packed one bit for bit.
    convert_checkpoint(tmp_path / "out", tmp_path / "repacked", dst_format="hf", hf_experts="packed")
    packed, repacked = safetensors_of(tmp_path / "packed"), safetensors_of(tmp_path / "repacked")
    assert packed.keys() == repacked.keys() and all(torch.equal(packed[k], repacked[k]) for k in packed)


@pytest.mark.parametrize("fmt, layout, message", [
    ("dcp", "per-expert", "--hf-experts applies to --to hf only"),
    ("hf", "split", "--hf-experts 'split' is not a layout; valid: packed, per-expert"),
])
def test_hf_experts_option_errors(theirs, tmp_path, fmt, layout, message):  # noqa: F811
    packed_folder(theirs, tmp_path / "packed")
    with pytest.raises(CheckpointError, match=re.escape(message)):
        convert_checkpoint(tmp_path / "packed", tmp_path / "out", dst_format=fmt, hf_experts=layout)
    assert not (tmp_path / "out").exists()


def test_hf_experts_option_needs_experts(trained_debug, tmp_path):
    with pytest.raises(CheckpointError, match="--hf-experts applies to Mixture-of-Experts models; llama3 has no experts"):
        convert_checkpoint(trained_debug["folder"], tmp_path / "out", dst_format="hf", hf_experts="per-expert")
    assert not (tmp_path / "out").exists()

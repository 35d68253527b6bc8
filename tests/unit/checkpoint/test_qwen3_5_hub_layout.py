"""Qwen3.5 folders as the Hub publishes them: vision-language wrappers (``Qwen3_5MoeForConditionalGeneration``,
``Qwen3_5ForConditionalGeneration``), built here in-process from tiny configs.

The layout, from transformers 5.23's own code (offline evidence): the wrapper's config nests the text model in
``text_config`` (configuration_qwen3_5*.py); its ``model.language_model`` holds the decoder, ``model.visual``
the vision encoder, and ``lm_head`` ties to ``model.language_model.embed_tokens`` (modeling_qwen3_5*.py);
``*ForCausalLM`` ignores ``^mtp.*`` and ``^model.visual.*`` and conversion_mapping.py strips the
``language_model`` prefix (``qwen3_5_text``, ``qwen3_5_moe_text``); the MoE experts are stored as the model holds
them, ``mlp.experts.gate_up_proj`` [E, 2F, D] and ``down_proj`` [E, D, F] (Qwen/Qwen3.5-35B-A3B's index names
``model.language_model.layers.{i}.mlp.experts.gate_up_proj``, ``mtp.layers.0.*``, ``model.visual.*``).

Checked: HF -> DCP -> HF keeps every text tensor bit for bit under the folder's own names (prefix and packed
experts), names what it left unread (mtp, visual) in one line, and ``*ForCausalLM`` loads the export with no
missing or unexpected key and the source's logits; the export converts again to itself, in new shards too.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.unit.checkpoint.test_qwen3_checkpoints import safetensors_of
from tests.unit.hf_reference import IDS, assert_round_trip_keeps_the_folder, unit_scale_
from tests.unit.models.families import qwen3_5_config, qwen3_5_moe_config
from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint
from titanctl.errors import CheckpointError
from titanctl.models.registry import build_model

VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64}
# Stand-ins for the parts titanctl does not build (their shapes are the vision tower's and MTP head's business).
NOT_BUILT = {"model.visual.patch_embed.proj.weight": (16, 3, 2, 4, 4), "model.visual.merger.linear_fc1.weight": (8, 16),
             "mtp.fc.weight": (64, 128), "mtp.layers.0.mlp.experts.0.gate_proj.weight": (32, 64)}


def hub_folder(case: str, folder, tied: bool = False):
    """The text model's weights under the wrapper's names (packed experts, as the model holds them), the
    wrapper's config.json, and tensors of the vision encoder and the MTP head. Returns the text model."""
    import transformers

    moe = case == "qwen3_5_moe"
    text = (qwen3_5_moe_config if moe else qwen3_5_config)(tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = (transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM)(text)
    unit_scale_(model)
    state = {("model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k): v.contiguous()
             for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    gen = torch.Generator().manual_seed(1)
    state.update({k: torch.randn(shape, generator=gen) for k, shape in NOT_BUILT.items()})
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    wrapper = (transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config)(
        text_config=text.to_dict(), vision_config=VISION, tie_word_embeddings=tied)
    wrapper.architectures = ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"]
    wrapper.to_json_file(folder / "config.json")
    return model.eval()


@pytest.mark.parametrize("case, tied", [("qwen3_5_moe", False), ("qwen3_5", True)], ids=["moe", "dense-tied"])
def test_the_hubs_folder_round_trips_in_its_own_names(case, tied, tmp_path):
    theirs = hub_folder(case, tmp_path / "hub", tied)
    report = convert_checkpoint(tmp_path / "hub", tmp_path / "dcp", dst_format="dcp")
    assert [n for n in report.notes if "left unread" in n] == [
        "4 tensors of the vision-language folder left unread, titanctl builds the text model only: model.visual.* "
        "(2, the vision encoder), mtp.* (2, the multi-token-prediction head); an export is that text model "
        f"({theirs.__class__.__name__}, under the folder's model.language_model. names)"]
    convert_checkpoint(tmp_path / "dcp", tmp_path / "back", dst_format="hf")
    source = {k: v for k, v in safetensors_of(tmp_path / "hub").items() if k not in NOT_BUILT}
    back = safetensors_of(tmp_path / "back")
    assert back.keys() == source.keys() and all(torch.equal(back[k], source[k]) for k in source)
    assert ("model.language_model.layers.0.mlp.experts.gate_up_proj" in back) == (case == "qwen3_5_moe")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == [theirs.__class__.__name__] and config["tie_word_embeddings"] == tied
    loaded, info = theirs.__class__.from_pretrained(tmp_path / "back", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, theirs(IDS).logits)
        state, args = load_checkpoint(tmp_path / "hub")  # what `train` reads from the folder
        ours = build_model(args)
        assert ours.load_state_dict(state, strict=False).missing_keys == (["output.weight"] if tied else [])
        # Tied, the parity suite's tolerance for the tied reference (families.py: 2.4e-4 measured).
        assert (ours.eval()(IDS) - theirs(IDS).logits).abs().max().item() <= (3e-4 if tied else 1e-4)
    # The export is a folder of its own: it converts back to itself, and new shards keep its names.
    convert_checkpoint(tmp_path / "back", tmp_path / "dcp2", dst_format="dcp")
    convert_checkpoint(tmp_path / "dcp2", tmp_path / "again", dst_format="hf")
    assert_round_trip_keeps_the_folder(tmp_path / "back", tmp_path / "again")
    convert_checkpoint(tmp_path / "dcp2", tmp_path / "sharded", dst_format="hf", max_shard_size="100KB")
    assert safetensors_of(tmp_path / "sharded").keys() == back.keys()


def test_a_wrapper_tensor_of_an_unknown_part_is_refused(tmp_path):
    """Only the parts the Hub's wrappers hold are left unread: anything else is named, not skipped."""
    hub_folder("qwen3_5", tmp_path / "hub")
    state = safetensors_of(tmp_path / "hub")
    state["model.audio_tower.proj.weight"] = torch.zeros(2, 2)
    save_file(state, str(tmp_path / "hub" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"unknown Hugging Face tensor 'model\.audio_tower\.proj\.weight'"):
        convert_checkpoint(tmp_path / "hub", tmp_path / "dcp", dst_format="dcp")

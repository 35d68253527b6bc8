"""Qwen3.5 folders as the Hub publishes them: vision-language wrappers (``Qwen3_5MoeForConditionalGeneration``,
``Qwen3_5ForConditionalGeneration``), built here in-process from tiny configs.

The layout, from transformers 5.23's own code (offline evidence): the wrapper's config nests the text model in
``text_config`` (configuration_qwen3_5*.py); its ``model.language_model`` holds the decoder, ``model.visual``
the vision encoder, and ``lm_head`` ties to ``model.language_model.embed_tokens`` (modeling_qwen3_5*.py);
``*ForCausalLM`` ignores ``^mtp.*`` and ``^model.visual.*`` and conversion_mapping.py strips the
``language_model`` prefix (``qwen3_5_text``, ``qwen3_5_moe_text``); the MoE experts are stored as the model holds
them, ``mlp.experts.gate_up_proj`` [E, 2F, D] and ``down_proj`` [E, D, F] (Qwen/Qwen3.5-35B-A3B's index names
``model.language_model.layers.{i}.mlp.experts.gate_up_proj``, ``mtp.layers.0.*``, ``model.visual.*``).

Checked: HF -> DCP -> HF is the folder again: every tensor bit for bit in its dtype under the folder's names
(the vision encoder and MTP head carried unchanged under ``hf_carried.*`` in DCP), the index's weight_map, the
wrapper's config.json (but for the documented keys), and ``*ForConditionalGeneration`` loads it with no missing
key and the source's logits; the carried parts are named in one line. ``--text-only`` writes the text model's
``*ForCausalLM`` folder, which transformers loads with no missing or unexpected key and the source's logits;
each export converts again to itself, in new shards too.
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
from titanctl.checkpoint.trust.reader import DCPFolder
from titanctl.errors import CheckpointError
from titanctl.models.registry import build_model

VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64,
          "patch_size": 4, "num_position_embeddings": 16}
# Stand-ins for the multi-token-prediction head (transformers builds none: its classes ignore ``^mtp.*``), one
# of them in bfloat16: carried tensors keep their dtype.
MTP = {"mtp.fc.weight": ((64, 128), torch.float32), "mtp.layers.0.mlp.experts.0.gate_proj.weight": ((32, 64),
                                                                                                     torch.bfloat16)}


def hub_folder(case: str, folder, tied: bool = False, shards: int = 1):
    """The Hub's wrapper, saved as the Hub holds it: its text model's weights under the wrapper's names (packed
    experts, as the model holds them), its vision encoder, tensors of an MTP head, the wrapper's config.json;
    in ``shards`` files with an index when more than one. Returns (the wrapper, its text model as
    ``*ForCausalLM`` with the same weights)."""
    import transformers

    moe = case == "qwen3_5_moe"
    text = (qwen3_5_moe_config if moe else qwen3_5_config)(tie_word_embeddings=tied)
    wrapper = (transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config)(
        text_config=text.to_dict(), vision_config=VISION, tie_word_embeddings=tied)
    wrapper.architectures = ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"]
    torch.manual_seed(0)
    causal = (transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM)(text)
    unit_scale_(causal)
    whole = (transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration)(
        wrapper)
    unit_scale_(whole.model.visual, torch.Generator().manual_seed(2))
    whole.model.language_model.load_state_dict(causal.model.state_dict())
    whole.lm_head.load_state_dict(causal.lm_head.state_dict())
    state = {k: v.contiguous() for k, v in whole.state_dict().items() if not (tied and k == "lm_head.weight")}
    gen = torch.Generator().manual_seed(1)
    state.update({k: torch.randn(shape, generator=gen).to(dtype) for k, (shape, dtype) in MTP.items()})
    folder.mkdir()
    names = sorted(state)
    files = {name: f"model-{i * shards // len(names) + 1:05d}-of-{shards:05d}.safetensors"
             for i, name in enumerate(names)} if shards > 1 else dict.fromkeys(names, "model.safetensors")
    for file in dict.fromkeys(files.values()):
        save_file({k: state[k] for k in names if files[k] == file}, str(folder / file), metadata={"format": "pt"})
    if shards > 1:
        metadata = {"total_parameters": sum(t.numel() for t in state.values()),
                    "total_size": sum(t.nbytes for t in state.values())}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": metadata, "weight_map": files}))
    wrapper.to_json_file(folder / "config.json")
    return whole.eval(), causal.eval()


CASES = pytest.mark.parametrize("case, tied, shards", [("qwen3_5_moe", False, 2), ("qwen3_5", True, 1)],
                                ids=["moe-sharded", "dense-tied"])


@CASES
def test_the_hubs_folder_round_trips_whole_and_bitwise_or_text_only(case, tied, shards, tmp_path):
    whole, causal = hub_folder(case, tmp_path / "hub", tied, shards)
    wrapper, text = whole.__class__.__name__, causal.__class__.__name__
    report = convert_checkpoint(tmp_path / "hub", tmp_path / "dcp", dst_format="dcp")
    carried = [name for name in safetensors_of(tmp_path / "hub") if name.startswith(("model.visual.", "mtp."))]
    visual = sum(name.startswith("model.visual.") for name in carried)
    assert [n for n in report.notes if "carried unchanged" in n] == [
        f"{len(carried)} tensors of the vision-language folder carried unchanged (titanctl builds and trains the "
        f"text model only): model.visual.* ({visual}, the vision encoder), mtp.* (2, the multi-token-prediction "
        f"head); a Hugging Face export writes them back ({wrapper}, under the folder's names), --text-only writes "
        f"the text model alone ({text})"]
    # In DCP, apart from the model's tensors, in their own dtype.
    entries = DCPFolder(tmp_path / "dcp").entries
    assert {k for k in entries if k.startswith("hf_carried.")} == {f"hf_carried.{name}" for name in carried}
    assert entries["hf_carried.mtp.layers.0.mlp.experts.0.gate_proj.weight"].properties.dtype == torch.bfloat16
    convert_checkpoint(tmp_path / "dcp", tmp_path / "back", dst_format="hf")
    assert_round_trip_keeps_the_folder(tmp_path / "hub", tmp_path / "back")  # tensors, index, config.json
    assert sorted(p.name for p in (tmp_path / "back").glob("*.safetensors")) == \
        sorted(p.name for p in (tmp_path / "hub").glob("*.safetensors"))
    if shards > 1:  # each tensor in the file that held it
        assert json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())["weight_map"] == \
            json.loads((tmp_path / "hub" / "model.safetensors.index.json").read_text())["weight_map"]
    loaded, info = whole.__class__.from_pretrained(tmp_path / "back", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and set(info["unexpected_keys"]) <= set(MTP)  # transformers ignores ^mtp.*
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, whole(IDS).logits)
    # --text-only: the text model's *ForCausalLM folder under the wrapper's names, as transformers loads it.
    report = convert_checkpoint(tmp_path / "dcp", tmp_path / "text", dst_format="hf", text_only=True)
    source = {k: v for k, v in safetensors_of(tmp_path / "hub").items() if not k.startswith(("model.visual.", "mtp."))}
    left = len(safetensors_of(tmp_path / "hub")) - len(source)
    visual = left - len(MTP)
    assert [n for n in report.notes if n.startswith("--text-only")] == [
        f"--text-only: {left} tensors of the vision-language folder left out: model.visual.* ({visual}, the vision "
        "encoder), mtp.* (2, the multi-token-prediction head); the export is the text model "
        f"({causal.__class__.__name__}, under the folder's model.language_model. names)"]
    back = safetensors_of(tmp_path / "text")
    assert back.keys() == source.keys() and all(torch.equal(back[k], source[k]) for k in source)
    assert ("model.language_model.layers.0.mlp.experts.gate_up_proj" in back) == (case == "qwen3_5_moe")
    config = json.loads((tmp_path / "text" / "config.json").read_text())
    assert config["architectures"] == [causal.__class__.__name__] and config["tie_word_embeddings"] == tied
    assert "text_config" not in config and "vision_config" not in config
    loaded, info = causal.__class__.from_pretrained(tmp_path / "text", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, causal(IDS).logits)
        state, args = load_checkpoint(tmp_path / "hub")  # what `train` reads from the folder
        ours = build_model(args)
        assert ours.load_state_dict(state, strict=False).missing_keys == (["output.weight"] if tied else [])
        # Tied, the parity suite's tolerance for the tied reference (families.py: 2.4e-4 measured).
        assert (ours.eval()(IDS) - causal(IDS).logits).abs().max().item() <= (3e-4 if tied else 1e-4)
    if tied:
        return  # the rest holds for any folder: checked on the sharded one
    # The export is the folder: it converts back to itself, and new shards keep its names.
    convert_checkpoint(tmp_path / "back", tmp_path / "dcp2", dst_format="dcp")
    convert_checkpoint(tmp_path / "dcp2", tmp_path / "again", dst_format="hf")
    assert_round_trip_keeps_the_folder(tmp_path / "back", tmp_path / "again")
    convert_checkpoint(tmp_path / "dcp2", tmp_path / "resharded", dst_format="hf", max_shard_size="100KB")
    assert safetensors_of(tmp_path / "resharded").keys() == safetensors_of(tmp_path / "back").keys()


def test_a_wrapper_tensor_of_an_unknown_part_is_refused(tmp_path):
    """Only the parts the Hub's wrappers hold are left unread: anything else is named, not skipped."""
    hub_folder("qwen3_5", tmp_path / "hub")
    state = safetensors_of(tmp_path / "hub")
    state["model.audio_tower.proj.weight"] = torch.zeros(2, 2)
    save_file(state, str(tmp_path / "hub" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"unknown Hugging Face tensor 'model\.audio_tower\.proj\.weight'"):
        convert_checkpoint(tmp_path / "hub", tmp_path / "dcp", dst_format="dcp")


def hub_folder_of(args, folder) -> dict[str, torch.Tensor]:
    """A Hub-style dense Qwen3.5 folder of titanctl's model ``args`` (random weights): the text model under the
    wrapper's names, a vision encoder's and an MTP head's tensors, the wrapper's config.json. Returns its tensors."""
    from titanctl.checkpoint.convert import save_state_dict

    with torch.device("meta"):
        shapes = build_model(args).state_dict()
    gen = torch.Generator().manual_seed(0)
    text_folder = folder.parent / f"{folder.name}-text"
    save_state_dict({k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in shapes.items()}, args, text_folder,
                    fmt="hf")
    text = json.loads((text_folder / "config.json").read_text())
    state = {k.replace("model.", "model.language_model.", 1): v for k, v in safetensors_of(text_folder).items()}
    state.update({k: torch.randn(shape, generator=gen).to(dtype) for k, (shape, dtype) in MTP.items()})
    state["model.visual.merger.linear_fc1.weight"] = torch.randn(8, 16, generator=gen)
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    wrapper = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
               "tie_word_embeddings": text["tie_word_embeddings"], "vision_config": VISION,
               "text_config": {k: v for k, v in text.items() if k != "architectures"}}
    (folder / "config.json").write_text(json.dumps(wrapper))
    return state


def assert_carries(folder, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A run's Hugging Face save of the folder ``state`` came from: the same names, the carried tensors bit for
    bit in their dtype, the text model trained, the wrapper's config.json."""
    saved = safetensors_of(folder)
    assert saved.keys() == state.keys()
    carried = {k: v for k, v in state.items() if k.startswith(("model.visual.", "mtp."))}
    assert len(carried) == 3 and all(saved[k].dtype == v.dtype and torch.equal(saved[k], v) for k, v in carried.items())
    assert not torch.equal(saved["model.language_model.norm.weight"], state["model.language_model.norm.weight"])
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and config["vision_config"] == VISION
    return saved


def test_a_run_from_the_hubs_folder_carries_its_other_parts(repo, tmp_path):
    """A run from the Hub's folder trains its text model; its DCP steps (read back by a resumed run) and its
    Hugging Face saves carry the vision encoder and MTP head unchanged, the save in the folder's names and
    wrapper config.json, with the trained text weights; `convert` of the step writes that same folder.
    (Sharded over ranks: tests/distributed/test_hub_folder_run.py.)"""
    from tests.conftest import TRUSTED_RUN
    from titanctl.config.recipe import load_config
    from titanctl.models.registry import model_args_from_config
    from titanctl.train.trainer import Trainer

    run = [*TRUSTED_RUN, "--training.steps", "1", "--checkpoint.last_save_in_hf", "--metrics.enable_tensorboard",
           "false", "--checkpoint.initial_load_model_weights_only", "--job.dump_folder", str(tmp_path / "run")]
    cfg = load_config(repo / "recipes" / "qwen3_5_debug.toml", run)
    state = hub_folder_of(model_args_from_config(cfg.model, 4352, cfg.training.seq_len), tmp_path / "hub")
    Trainer(load_config(repo / "recipes" / "qwen3_5_debug.toml",
                        [*run, "--checkpoint.initial_load_path", str(tmp_path / "hub")])).train()
    root = tmp_path / "run" / "checkpoint"
    convert_checkpoint(root / "step-1", tmp_path / "exported", dst_format="hf")
    saved, exported = assert_carries(root / "step-1-hf", state), safetensors_of(tmp_path / "exported")
    assert all(torch.equal(exported[k], v) for k, v in saved.items())
    Trainer(load_config(repo / "recipes" / "qwen3_5_debug.toml", [*run, "--training.steps", "2"])).train()  # resumes
    assert_carries(root / "step-2-hf", state)

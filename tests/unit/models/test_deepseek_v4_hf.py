"""DeepSeek-V4's Hugging Face format beyond the conformance suite's round trips (test_conformance.py): the
config.json titanctl writes from a model's arguments alone (a model trained from scratch) is one transformers
builds the same model from, with 0 missing keys and titanctl's logits; DeepSeek's own config keys read as
transformers reads them; the Hub's own folder names (no ``model.`` prefix) read and are written back; the
token -> experts table stays int64 through a bf16 export and a float one is refused; bad configs are refused
in one line."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.unit.hf_reference import IDS, args_of, titanctl_model_of
from tests.unit.models.families import REFERENCES
from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint, open_checkpoint
from titanctl.checkpoint.hf.names import args_from_hf_config, from_hf_state_dict, hf_config, to_hf_state_dict
from titanctl.checkpoint.run.load_into_model import load_source_into
from titanctl.errors import CheckpointError
from titanctl.models.deepseek_v4.hf import PUBLISHED_TOP_NAMES
from titanctl.models.deepseek_v4.moe import hash_table
from titanctl.models.registry import build_model

REFERENCE = next(r for r in REFERENCES if r.family == "deepseek_v4")
TABLE = "model.layers.0.ffn.gate.tid2eid"


@pytest.fixture(scope="module")
def theirs():
    return REFERENCE.build()


def test_a_config_written_from_the_arguments_builds_the_same_model_in_transformers(theirs, tmp_path):
    """No carried config.json: transformers reads titanctl's, loads titanctl's tensors with nothing missing
    or unexpected, and gives titanctl's logits (the checkpoint's hash table, not titanctl's seeded one)."""
    import transformers

    args = args_of(theirs)
    ours = titanctl_model_of(theirs, state=REFERENCE.hf_state_dict(theirs))
    assert not torch.equal(ours.layers["0"].mlp.tid2eid, hash_table(args.vocab_size, 4, 2, 0))
    config = hf_config(args)
    assert args_from_hf_config(config, max_seq_len=args.max_seq_len) == args
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in to_hf_state_dict(ours.state_dict(), args).items()},
              str(tmp_path / "model.safetensors"))
    reloaded, info = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters", "qk_rope_head_dim"):
        assert getattr(reloaded.config, key) == getattr(theirs.config, key), key
    with torch.no_grad():
        assert (ours(IDS) - reloaded.eval()(IDS).logits).abs().max() <= REFERENCE.tol


def test_deepseeks_own_config_keys_read_as_transformers_reads_them(theirs):
    """compress_ratios per layer (with the MTP layer's), num_hash_layers, qk_rope_head_dim and a flat
    rope_scaling: the published config.json's spelling."""
    import transformers

    legacy = {"model_type": "deepseek_v4", "vocab_size": 512, "hidden_size": 32, "moe_intermediate_size": 16,
              "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 16, "qk_rope_head_dim": 4,
              "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8, "sliding_window": 128, "compress_ratios": [0, 4, 128, 4, 0],
              "num_hash_layers": 2, "index_n_heads": 2, "index_head_dim": 8, "index_topk": 3, "hc_mult": 2,
              "n_routed_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 256, "rope_theta": 10000.0,
              "num_nextn_predict_layers": 1,
              "compress_rope_theta": 160000.0, "rope_scaling": {"type": "yarn", "factor": 16.0, "beta_fast": 32,
                                                                "beta_slow": 1, "original_max_position_embeddings": 16}}
    ours = args_from_hf_config(legacy, max_seq_len=64)
    read = transformers.DeepseekV4Config(**{k: v for k, v in legacy.items() if k != "rope_scaling"},
                                         rope_parameters=legacy["rope_scaling"]).to_dict()
    assert ours == args_from_hf_config(read, max_seq_len=64)
    assert ours.layer_types[1:3] == ("compressed_sparse_attention", "heavily_compressed_attention")
    assert ours.compressed_attention.hash_layers == 2 and ours.rope_dim == 4
    assert ours.compressed_attention.compress_yarn == (16.0, 16, 32.0, 1.0)


def test_the_hubs_folder_names_read_and_an_export_keeps_them(theirs, tmp_path):
    """A tiny folder in the published layout (save_pretrained's tensors renamed: layers.{i}.*, embed.weight,
    norm.weight, hc_head_fn, ...; plus a multi-token-prediction tensor): transformers loads it with nothing
    missing, titanctl reads the same tensors as from save_pretrained's folder (into a fresh model: the folder's
    hash table replaces the seeded one, and the logits are transformers'), carries mtp.* unchanged for a model
    without depths (one line says so; a model with one reads mtp.0.* into it: here incomplete, refused), and an export (HF -> DCP -> HF) writes the Hub's names back bit for bit, mtp.* included."""
    import transformers

    theirs.save_pretrained(tmp_path / "saved")
    hub = {PUBLISHED_TOP_NAMES.get(k, k.removeprefix("model.")): v
           for k, v in load_file(tmp_path / "saved" / "model.safetensors").items()}
    assert "layers.0.ffn.experts.3.w3.weight" in hub and "embed.weight" in hub and "head.weight" in hub
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "config.json").write_text((tmp_path / "saved" / "config.json").read_text())
    save_file(hub, str(tmp_path / "hub" / "model.safetensors"))
    _, info = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "hub", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    save_file({**hub, "mtp.0.norm.weight": torch.ones(32)}, str(tmp_path / "hub" / "model.safetensors"))
    report = convert_checkpoint(tmp_path / "hub", tmp_path / "dcp", dst_format="dcp")
    assert report.notes == ["1 tensors of the published folder carried unchanged (titanctl does not build them): "
                            "mtp.* (1, the multi-token-prediction head); a Hugging Face export writes them back "
                            "under the folder's names"]
    with torch.device("meta"):  # an initial load (train --checkpoint.initial_load_path): a fresh model's table
        model = build_model(args_of(theirs))
    model.to_empty(device="cpu").init_buffers("cpu")
    with open_checkpoint(tmp_path / "hub") as source:
        load_source_into(model, source)
    assert torch.equal(model.layers["0"].mlp.tid2eid, hub["layers.0.ffn.gate.tid2eid"])
    with open_checkpoint(tmp_path / "hub") as source:  # a model with a depth reads mtp.0.*: here only its norm
        with pytest.raises(CheckpointError, match=r"hub lacks tensor\(s\) layers.3.attn_hc.fn, .* \(and 27 more\) "
                                                  r"that the model from the recipe has"):
            source.bind(model.args.replace(mtp_layers=1), "the recipe")
    with torch.no_grad():
        assert (model.eval()(IDS) - theirs(IDS).logits).abs().max() <= REFERENCE.tol
    ours, args = load_checkpoint(tmp_path / "dcp")
    saved = from_hf_state_dict(REFERENCE.hf_state_dict(theirs), args)  # what save_pretrained's names read to
    assert ours.keys() == saved.keys() and all(torch.equal(ours[k], saved[k]) for k in saved)
    convert_checkpoint(tmp_path / "dcp", tmp_path / "back", dst_format="hf")
    back, hub = load_file(tmp_path / "back" / "model.safetensors"), load_file(tmp_path / "hub" / "model.safetensors")
    assert back.keys() == hub.keys() and all(torch.equal(back[k], hub[k]) for k in hub)  # mtp.0.norm.weight too


def test_the_hash_table_stays_int64_through_a_bf16_export_and_a_float_one_is_refused(theirs, tmp_path):
    theirs.save_pretrained(tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "bf16", dst_format="hf", dtype="bfloat16")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as before, \
            safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as after:
        assert after.get_tensor(TABLE).dtype == torch.int64
        assert torch.equal(after.get_tensor(TABLE), before.get_tensor(TABLE))
        assert after.get_tensor("head.weight").dtype == torch.bfloat16
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[TABLE] = tensors[TABLE].float()
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"tensor '{TABLE}' in model.safetensors has dtype torch.float32, "
                                              "not an integer$"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "dcp", dst_format="dcp")


@pytest.mark.parametrize("change, message", [
    ({"scoring_func": "softmax"}, "scoring_func 'softmax': titanctl's DeepSeek-V4 scores experts by sqrt(softplus)"),
    ({"mlp_layer_types": ["moe", "hash_moe", "moe"]},
     "mlp_layer_types ['moe', 'hash_moe', 'moe']: titanctl's DeepSeek-V4 routes the first layers by hash"),
    ({"compress_rates": {"compressed_sparse_attention": 3, "heavily_compressed_attention": 4}},
     "compress_rates['compressed_sparse_attention'] is 3: it must be a positive divisor of sliding_window 8"),
    ({"n_shared_experts": 2}, "n_shared_experts 2: DeepSeek-V4 has 1"),
    ({"compress_ratios": [0, 5, 0], "layer_types": None}, "compress_ratios is [0, 5, 0], expected 3 or more of 0, 4, 128"),
])
def test_a_config_the_model_cannot_build_is_refused_in_one_line(theirs, change, message):
    config = {**theirs.config.to_dict(), **change}
    with pytest.raises(CheckpointError, match="^config.json: " + re.escape(message)) as err:
        args_from_hf_config(config, where="config.json")
    assert "\n" not in str(err.value)


def test_a_layouts_unprefixed_naming_is_a_familys_own():
    """The naming a DCP checkpoint carries (titanctl.json) names tensors only as a family's published folder
    does: other renames fall back to save_pretrained's names."""
    from titanctl.checkpoint.hf.hub_layout import NAMING_KEY, HubNaming

    published = HubNaming("", renamed=tuple(PUBLISHED_TOP_NAMES.items()))
    assert HubNaming.of_layout({NAMING_KEY: published.to_json()}) == published
    assert published.stored("model.layers.2.attn.wq_a.weight") == "layers.2.attn.wq_a.weight"
    assert published.text_name("hc_head_fn") == "model.hc_head.hc_fn"
    # Prediction depth k of a 3-layer model: model.layers.{3 + k}.* as save_pretrained names it, mtp.{k}.* here.
    assert published.stored("model.layers.4.hc_head_fn", 3) == "mtp.1.hc_head_fn"
    assert published.text_name("mtp.1.hc_head_fn", 3) == "model.layers.4.hc_head_fn"
    assert published.stored("model.layers.2.attn.wq_a.weight", 3) == "layers.2.attn.wq_a.weight"
    forged = {**published.to_json(), "renamed": [["model.embed_tokens.weight", "../../etc"]]}
    assert HubNaming.of_layout({NAMING_KEY: forged}) == HubNaming()

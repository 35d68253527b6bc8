"""Hostile config.json, round 4 (issue 57, class 7): one reader of config.json numbers, booleans and lists
for every family (models/common/hf_config.ConfigJson). ``"1e-6"`` and ``"false"`` as strings were
accepted (``bool("false")`` is True) while ``hidden_size "256"`` was refused; a Qwen3 ``layer_types`` of 7
entries for 6 layers was accepted; gpt-oss ``rope_scaling.factor 0`` converted; NaN attention sinks beside
MXFP4 blocks were copied. Each is now a one-line CheckpointError naming the key. In-process."""

from __future__ import annotations

import json

import pytest
import torch

from titanctl.checkpoint.hf.names import args_from_hf_config, hf_config
from titanctl.checkpoint.quantized.mxfp4 import check_finite
from titanctl.errors import CheckpointError
from titanctl.models.registry import flavor_args

FAMILIES = ("llama3", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3")


def config_of(family: str) -> dict:
    """The config.json titanctl writes for the family's debug flavor (valid: the cases below change one key)."""
    return json.loads(json.dumps(hf_config(args_of(family))))


def args_of(family: str):
    return flavor_args(f"{family}:debugmodel").replace(vocab_size=4352)  # the flavor takes its tokenizer's


def refused(config: dict) -> str:
    with pytest.raises(CheckpointError) as e:
        args_from_hf_config(config, where="config.json")
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("key, value, says", [
    ("rms_norm_eps", "1e-6", "rms_norm_eps is '1e-6' (a string), expected a finite number > 0"),
    ("tie_word_embeddings", "false", "tie_word_embeddings is 'false' (a string), expected true or false"),
    ("hidden_size", "256", "hidden_size is '256' (a string), expected an integer >= 1"),
    ("num_hidden_layers", 2.5, "num_hidden_layers is 2.5, expected an integer >= 1"),
    ("vocab_size", True, "vocab_size is True, expected an integer >= 1"),
    ("num_attention_heads", 0, "num_attention_heads is 0, expected an integer >= 1"),
    ("max_position_embeddings", "4096", "max_position_embeddings is '4096' (a string), expected an integer >= 0"),
    ("rope_theta", "500000", "rope_theta is '500000' (a string), expected a finite number > 0"),
    ("rope_scaling", "yes", "rope_scaling is 'yes' (a string), expected an object"),
])
def test_a_number_or_boolean_of_the_wrong_type_is_refused_in_every_family(family, key, value, says):
    config = config_of(family)
    config[key] = value
    if key == "rope_theta":  # 5.x keys are read when 4.x's are absent: both are read the same way
        config.pop("rope_parameters", None)
    assert refused(config) == f"config.json: {says}"


@pytest.mark.parametrize("family, changes, says", [
    ("qwen3", {"layer_types": ["full_attention"] * 7},
     "layer_types is ['full_attention', 'full_attention', 'full_attention', 'full..., expected a list of 6 of "
     "full_attention (one per layer)"),
    ("qwen3", {"layer_types": ["sliding_attention"] * 6}, "expected a list of 6 of full_attention (one per layer)"),
    ("qwen3_moe", {"layer_types": "full_attention"}, "expected a list of 6 of full_attention (one per layer)"),
    ("gpt_oss", {"layer_types": ["full_attention"] * 3},
     "expected a list of 4 of full_attention, sliding_attention (one per layer)"),
    ("gpt_oss", {"rope_scaling__factor": 0}, "rope_scaling.factor is 0, expected a finite number >= 1"),
    ("gpt_oss", {"rope_scaling__factor": "32"}, "rope_scaling.factor is '32' (a string), expected a finite number"),
    ("gpt_oss", {"attention_bias": "false"}, "attention_bias is 'false' (a string), expected true or false"),
    ("gpt_oss", {"swiglu_limit": -1}, "swiglu_limit is -1, expected a finite number > 0"),
    ("gpt_oss", {"sliding_window": "128"}, "sliding_window is '128' (a string), expected an integer"),
    ("qwen3_moe", {"norm_topk_prob": "true"}, "norm_topk_prob is 'true' (a string), expected true or false"),
    ("qwen3_moe", {"num_experts_per_tok": "2"}, "num_experts_per_tok is '2' (a string), expected an integer >= 1"),
    ("deepseek_v3", {"routed_scaling_factor": 0}, "routed_scaling_factor is 0, expected a finite number > 0"),
    ("deepseek_v3", {"rope_interleave": 1}, "rope_interleave is 1, expected true or false"),
    ("deepseek_v3", {"n_group": -2}, "n_group is -2, expected an integer >= 0"),
    ("llama3", {"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1}},
     "rope_scaling.high_freq_factor 1 must exceed low_freq_factor 4"),
    ("llama3", {"rope_scaling": {"rope_type": "llama3", "factor": 0, "low_freq_factor": 1, "high_freq_factor": 4}},
     "rope_scaling.factor is 0, expected a finite number >= 1"),
    ("llama3", {"attention_bias": "false"}, "attention_bias is 'false' (a string), expected true or false"),
])
def test_family_keys_are_read_through_the_same_reader(family, changes, says):
    config = config_of(family)
    for key, value in changes.items():
        if "__" in key:
            section, name = key.split("__")
            config[section] = {**(config.get(section) or {"rope_type": "yarn", "factor": 32,
                                                           "original_max_position_embeddings": 64}), name: value}
        else:
            config[key] = value
    message = refused(config)
    assert message.startswith("config.json: ") and says in message, message


@pytest.mark.parametrize("family", FAMILIES)
def test_the_configs_titanctl_writes_still_read_back(family):
    args = args_of(family)
    assert hf_config(args_from_hf_config(config_of(family), max_seq_len=args.max_seq_len)) == hf_config(args)


def test_a_non_finite_tensor_beside_mxfp4_blocks_is_refused(tmp_path):
    """The MXFP4 values were checked, the tensors beside them (attention sinks) were not."""
    sinks = torch.zeros(4, 8)
    assert check_finite(sinks, "model.layers.0.self_attn.sinks", tmp_path / "a.safetensors") is sinks
    for bad in (float("nan"), float("inf")):
        sinks[3, 7] = bad
        with pytest.raises(CheckpointError) as e:
            check_finite(sinks, "model.layers.0.self_attn.sinks", tmp_path / "a.safetensors")
        assert str(e.value) == (f"{tmp_path / 'a.safetensors'}: tensor 'model.layers.0.self_attn.sinks' holds a value "
                                "that is not finite (NaN or infinity); a model holding it computes NaN")
    assert check_finite(torch.tensor(1.0), "s", tmp_path) is not None
    assert check_finite(torch.zeros(3, dtype=torch.int64), "i", tmp_path) is not None

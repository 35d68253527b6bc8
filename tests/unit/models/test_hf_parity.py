"""Our Llama forward equals transformers' LlamaForCausalLM, through the HF adapter, both ways.

transformers is a test-only reference: the runtime never imports it.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.unit.hf_reference import max_logit_delta as max_delta
from tests.unit.hf_reference import tokens, unit_scale_
from titanctl.checkpoint.hf.names import (
    args_from_hf_config,
    from_hf_state_dict,
    hf_config,
    iter_from_hf,
    to_hf_state_dict,
)
from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs, RopeScaling
from titanctl.models.common.decoder import Transformer
from titanctl.models.common.rope import rope_frequencies
from titanctl.models.llama.args import LLAMA3_FLAVORS
from titanctl.parallel.layouts.weight_init import initialize_weights

# original_max_position_embeddings=16 puts every frequency of head_dim 8 in a scaled regime.
ARGS = ModelArgs(
    dim=64,
    n_layers=3,
    n_heads=8,
    n_kv_heads=2,
    vocab_size=512,
    max_seq_len=64,
    rope_scaling=RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
    ),
)
TOL = 1e-4


@pytest.fixture(scope="module")
def transformers(tmp_path_factory):
    """transformers, imported and used offline with a throw-away HF_HOME."""
    with pytest.MonkeyPatch.context() as mp:
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            mp.setenv(var, "1")
        mp.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
        import transformers

        yield transformers


@pytest.fixture(scope="module")
def ours() -> Transformer:
    model = Transformer(ARGS)
    initialize_weights(model, seed=0)
    unit_scale_(model)
    return model.eval()


@pytest.fixture(scope="module")
def exported(ours, transformers, tmp_path_factory):
    """Our model written as an HF checkpoint and loaded by transformers."""
    folder = tmp_path_factory.mktemp("hf_export")
    hf_sd = to_hf_state_dict(ours.state_dict(), ARGS)
    save_file(hf_sd, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(ARGS), indent=2))
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_scaled_rope_matters_here():
    scaled = rope_frequencies(ARGS.head_dim, ARGS.rope_theta, ARGS.rope_scaling)
    unscaled = rope_frequencies(ARGS.head_dim, ARGS.rope_theta, None)
    assert (scaled != unscaled).all(), (scaled, unscaled)


def test_export_matches_transformers(ours, exported):
    assert exported.config.rope_parameters["rope_type"] == "llama3"
    # transformers derived the same (scaled) frequencies from our config.json.
    torch.testing.assert_close(
        exported.model.rotary_emb.inv_freq,
        rope_frequencies(ARGS.head_dim, ARGS.rope_theta, ARGS.rope_scaling),
        rtol=1e-6,
        atol=0,
    )
    delta = max_delta(ours, exported, tokens(ARGS.vocab_size))
    assert delta <= TOL, f"max |Δlogit| = {delta:.3g} with the q/k permutation"


def test_without_permutation_differs(ours, exported):
    theirs = copy.deepcopy(exported)
    hf_sd = to_hf_state_dict(ours.state_dict(), ARGS)
    plain = ours.state_dict()  # the same tensors, but q/k rows left in Meta's interleaved order
    for i in range(ARGS.n_layers):
        hf_sd[f"model.layers.{i}.self_attn.q_proj.weight"] = plain[f"layers.{i}.attention.wq.weight"]
        hf_sd[f"model.layers.{i}.self_attn.k_proj.weight"] = plain[f"layers.{i}.attention.wk.weight"]
    theirs.load_state_dict(hf_sd, strict=True)
    delta = max_delta(ours, theirs, tokens(ARGS.vocab_size))
    assert delta > 1e-1, f"max |Δlogit| = {delta:.3g} without the q/k permutation: test has no teeth"


def test_round_trip_is_bit_identical(ours):
    sd = ours.state_dict()
    for dtype in (torch.float32, torch.bfloat16):
        cast = {k: v.to(dtype) for k, v in sd.items()}
        hf_sd = to_hf_state_dict(cast, ARGS)
        k_hf, k_meta = hf_sd["model.layers.0.self_attn.k_proj.weight"], cast["layers.0.attention.wk.weight"]
        assert not torch.equal(k_hf, k_meta)  # the permutation did something
        back = from_hf_state_dict(hf_sd, ARGS)
        assert list(back) == list(cast)
        for name, value in cast.items():
            assert back[name].dtype == dtype and torch.equal(back[name], value), name


def test_import_checkpoint_written_by_transformers(transformers, tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=384,
        hidden_size=96,
        intermediate_size=200,  # not what ModelArgs' defaults would give: must be matched exactly
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config)
    unit_scale_(theirs, torch.Generator().manual_seed(1))
    theirs.save_pretrained(tmp_path)

    cfg = json.loads((tmp_path / "config.json").read_text())
    args = args_from_hf_config(cfg)
    assert args.ffn_hidden_dim == 200 and args.kv_heads == 3 and args.norm_eps == 1e-6
    assert args.rope_theta == 50000.0 and args.rope_scaling == RopeScaling(4.0, 1.0, 4.0, 32)
    model = Transformer(args)
    model.load_state_dict(from_hf_state_dict(load_file(tmp_path / "model.safetensors"), args), strict=True)
    delta = max_delta(model.eval(), theirs.eval(), tokens(args.vocab_size))
    assert delta <= TOL, f"max |Δlogit| = {delta:.3g} importing a transformers checkpoint"


def test_wrong_shape_names_the_tensor(ours):
    hf_sd = to_hf_state_dict(ours.state_dict(), ARGS)
    name = "model.layers.1.self_attn.k_proj.weight"
    hf_sd[name] = hf_sd[name][:8]
    with pytest.raises(CheckpointError) as err:
        from_hf_state_dict(hf_sd, ARGS)
    message = str(err.value)
    assert name in message and "(8, 64)" in message and "(16, 64)" in message and "\n" not in message

    sd = dict(ours.state_dict())
    sd["output.weight"] = sd["output.weight"][:, :32]
    with pytest.raises(CheckpointError, match=r"'output\.weight'.*\(512, 32\).*\(512, 64\)"):
        to_hf_state_dict(sd, ARGS)


def test_unknown_and_missing_tensors(ours):
    hf_sd = to_hf_state_dict(ours.state_dict(), ARGS)
    with pytest.raises(CheckpointError, match="model.layers.3.mlp.up_proj.weight"):  # only 3 layers
        from_hf_state_dict({**hf_sd, "model.layers.3.mlp.up_proj.weight": torch.zeros(1)}, ARGS)
    with pytest.raises(CheckpointError, match="model.extra.weight"):
        from_hf_state_dict({**hf_sd, "model.extra.weight": torch.zeros(1)}, ARGS)
    del hf_sd["lm_head.weight"]
    with pytest.raises(CheckpointError, match="lacks.*lm_head.weight"):
        from_hf_state_dict(hf_sd, ARGS)
    # Old transformers saved the derived RoPE buffer: skipped, not an error.
    stream = iter_from_hf([("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(4))], ARGS)
    with pytest.raises(CheckpointError, match="lacks"):
        list(stream)


@pytest.mark.parametrize(
    "args",
    [
        ARGS,
        ARGS.replace(rope_scaling=None, n_kv_heads=None, norm_eps=1e-6, rope_theta=10000.0),
        *(LLAMA3_FLAVORS[f].replace(vocab_size=128256) for f in ("8B", "70B", "405B")),
    ],
    ids=["tiny", "tiny-unscaled", "8B", "70B", "405B"],
)
def test_config_round_trip(args):
    cfg = hf_config(args, bos_token_id=128000, eos_token_id=128001)
    assert cfg["intermediate_size"] == args.ffn_hidden_dim
    if args.rope_scaling is not None:
        assert cfg["max_position_embeddings"] > cfg["rope_scaling"]["original_max_position_embeddings"]
    v4 = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    v5 = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling")}
    for variant in (cfg, v4, v5):
        back = args_from_hf_config(json.loads(json.dumps(variant)), max_seq_len=args.max_seq_len)
        assert back.ffn_hidden_dim == args.ffn_hidden_dim
        # multiple_of / ffn_dim_multiplier may be another pair giving the same FFN size.
        same_ffn = back.replace(multiple_of=args.multiple_of, ffn_dim_multiplier=args.ffn_dim_multiplier)
        assert same_ffn == args.replace(n_kv_heads=args.kv_heads)


def test_published_config_values():
    cfg = hf_config(LLAMA3_FLAVORS["8B"].replace(vocab_size=128256, max_seq_len=8192), torch_dtype="bfloat16")
    assert cfg["max_position_embeddings"] == 131072  # as Meta publishes for Llama 3.1
    assert cfg["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 500000.0
    assert cfg["tie_word_embeddings"] is False and cfg["hidden_act"] == "silu"
    # Llama 3.2's small models tie the output layer to the embedding (issue 21: no longer refused).
    assert args_from_hf_config({**cfg, "tie_word_embeddings": True}).tie_embeddings is True
    with pytest.raises(CheckpointError, match="RoPE type 'yarn'"):
        args_from_hf_config({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(CheckpointError, match="hidden_size"):
        args_from_hf_config({k: v for k, v in cfg.items() if k != "hidden_size"})


@pytest.mark.parametrize("keys", ["both", "4.x-only", "5.x-only"])
@pytest.mark.parametrize("scaled", [True, False], ids=["llama3-rope", "default-rope"])
def test_transformers_reads_our_rope_config(transformers, keys, scaled):
    args = ARGS if scaled else ARGS.replace(rope_scaling=None, rope_theta=20000.0)
    cfg = hf_config(args)
    if keys == "4.x-only":
        del cfg["rope_parameters"]
    elif keys == "5.x-only":
        del cfg["rope_theta"], cfg["rope_scaling"]
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(
        transformers.LlamaConfig.from_dict(json.loads(json.dumps(cfg)))
    )
    want = rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling)
    torch.testing.assert_close(rotary.inv_freq, want, rtol=1e-6, atol=0)

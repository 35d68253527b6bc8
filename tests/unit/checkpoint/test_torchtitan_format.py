"""torchtitan checkpoints both ways: 0.3 and <= 0.2 names, weights-only and full training checkpoints,
models without a config (from --flavor, --config or inferred from shapes, torchtitan's own multi-head
debugmodel included), and HF folders without config.json.

The torchtitan folders here are written by the test itself with DCP, as torchtitan 0.3's
CheckpointManager lays them out: the model state dict flat at the top level, beside the
optimizer, lr_scheduler, dataloader and train_state entries of a full checkpoint. Qwen3, Qwen3-MoE
and DeepSeek-V3 are checked against torchtitan 0.3.0's state dict as its source defines it. torchtitan
itself is not imported: it cannot be installed beside this venv's datasets 5.2.0 (it pins
datasets<4.8.0); scripts/check_torchtitan_interop.py runs its own CheckpointManager and models, in a
scratch venv, on the same names.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import REPO
from tests.unit.trained_model import loss_of
from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint, open_checkpoint, save_state_dict
from titanctl.checkpoint.formats import detect
from titanctl.errors import CheckpointError, ConfigError
from titanctl.models.common.args import ModelArgs
from titanctl.models.llama.args import LLAMA3_FLAVORS
from titanctl.models.registry import build_model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# What torchtitan 0.3 calls the weights that it renamed (torchtitan/models/llama3/state_dict_adapter.py).
QKV = re.compile(r"layers\.(\d+)\.attention\.(wq|wk|wv)\.weight")


def torchtitan_03_name(name: str) -> str:
    if name == "output.weight":
        return "lm_head.weight"
    return QKV.sub(r"layers.\1.attention.qkv_linear.\2.weight", name)


def training_state(model_sd: dict[str, torch.Tensor]) -> dict:
    """Entries of a torchtitan full checkpoint besides the model (their shapes as torchtitan saves them)."""
    return {
        "optimizer": {
            "state": {n: {"exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.ones_like(t), "step": torch.tensor(7.0)}
                      for n, t in model_sd.items()},
            "param_groups": {n: {"lr": 8e-4, "betas": (0.9, 0.95)} for n in model_sd},
        },
        "lr_scheduler": {"lr_scheduler_0": {"last_epoch": 7, "base_lrs": [8e-4]}},
        "dataloader": {"dp_rank_0": pickle.dumps({"sample_idx": 99}), "world_size": 1},
        "train_state": {"step": 7, "ntokens_seen": 7 * 8 * 64},
    }


def write_torchtitan(folder, state: dict[str, torch.Tensor], *, names="0.3", full=False) -> None:
    model_sd = {torchtitan_03_name(k) if names == "0.3" else k: v for k, v in state.items()}
    dcp.save({**model_sd, **(training_state(model_sd) if full else {})}, checkpoint_id=str(folder), no_dist=True)


def stored(folder) -> dict:
    return dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.fixture(scope="module")
def transformers(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
        import transformers

        yield transformers


@pytest.mark.parametrize("full", [False, True], ids=["weights-only", "full"])
@pytest.mark.slow
def test_torchtitan_03_checkpoint_converts_to_hf_and_matches_transformers(trained_debug, transformers, tmp_path, full):
    step = tmp_path / "step-7"
    write_torchtitan(step, trained_debug["state"], full=full)
    assert detect(step) == "torchtitan"
    report = convert_checkpoint(step, tmp_path / "hf", dst_format="hf")
    # No titanctl.json: the model comes from the shapes, which are the debug flavor's with 2 layers.
    assert report.src_format == "torchtitan" and report.origin.startswith("tensor shapes")
    assert "flavor debugmodel's with 2 layers" in report.origin
    assert report.args == trained_debug["args"].replace(max_seq_len=report.args.max_seq_len)
    assert "torchtitan 0.3 names (attention.qkv_linear.*, lm_head)" in report.notes
    ignored = [n for n in report.notes if n.startswith("full training checkpoint")]
    if full:
        assert ignored == ["full training checkpoint: model weights taken; dataloader, lr_scheduler, optimizer, "
                           "train_state ignored"]
    else:
        assert not ignored
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ours = build_model(trained_debug["args"])
    ours.load_state_dict(trained_debug["state"])
    ids = trained_debug["held_out"][:4, :-1]
    with torch.no_grad():
        delta = (ours.eval()(ids) - theirs(ids).logits).abs().max().item()
    assert delta <= 1e-4, delta
    assert loss_of(theirs, trained_debug["held_out"]) == pytest.approx(trained_debug["loss"], rel=1e-5)


def test_torchtitan_02_names_are_read_too(trained_debug, tmp_path):
    write_torchtitan(tmp_path / "old", trained_debug["state"], names="<=0.2", full=True)
    with open_checkpoint(tmp_path / "old") as source:
        assert source.format == "torchtitan" and "torchtitan <= 0.2 names" in source.notes
        assert_same(dict(source.iter_tensors()), trained_debug["state"])


def test_titanctl_to_torchtitan_and_back_is_bit_identical(trained_debug, tmp_path):
    there = convert_checkpoint(trained_debug["folder"], tmp_path / "tt", dst_format="torchtitan")
    assert (there.src_format, there.dst_format) == ("dcp", "torchtitan")
    entries = stored(tmp_path / "tt")
    # torchtitan 0.3's model state dict keys, flat at the top level of the DCP state dict, nothing else.
    assert set(entries) == {torchtitan_03_name(k) for k in trained_debug["state"]}
    assert "layers.1.attention.qkv_linear.wk.weight" in entries and "lm_head.weight" in entries
    assert not (tmp_path / "tt" / "titanctl.json").exists()
    assert detect(tmp_path / "tt") == "torchtitan"
    back = convert_checkpoint(tmp_path / "tt", tmp_path / "back", dst_format="dcp")
    assert back.origin == "params.json" and back.args == trained_debug["args"].replace(max_seq_len=back.args.max_seq_len)
    for folder in ("tt", "back"):
        sd, _ = load_checkpoint(tmp_path / folder)
        assert_same(sd, trained_debug["state"])


def test_bf16_export_round_trips(trained_debug, tmp_path):
    convert_checkpoint(trained_debug["folder"], tmp_path / "tt", dst_format="torchtitan", dtype="bf16")
    assert {e.properties.dtype for e in stored(tmp_path / "tt").values()} == {torch.bfloat16}
    convert_checkpoint(tmp_path / "tt", tmp_path / "back", dst_format="dcp")
    sd, _ = load_checkpoint(tmp_path / "back")
    assert_same(sd, {k: v.to(torch.bfloat16) for k, v in trained_debug["state"].items()})


def test_a_model_without_config_needs_flavor_when_shapes_cannot_say(tmp_path):
    args = ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=300, max_seq_len=32)
    torch.manual_seed(0)
    state = build_model(args).state_dict()
    write_torchtitan(tmp_path / "tt", state, full=True)
    with pytest.raises(CheckpointError, match=r"tensor shapes say dim 64, 2 layers, vocab 300, query width 64, "
                                              r"key/value width 16, ffn 256.*n_heads cannot be inferred.*--flavor"):
        load_checkpoint(tmp_path / "tt")
    recipe = tmp_path / "tiny.toml"
    recipe.write_text('[model]\nflavor = "debugmodel"\nn_layers = 2\n')
    with pytest.raises(CheckpointError, match=r"has shape \(300, 64\), expected \(300, 256\) for the model from --config"):
        load_checkpoint(tmp_path / "tt", config=recipe)
    # --section.key overrides change the recipe, and only its model's shape.
    with pytest.raises(CheckpointError, match="--model.n_layers 2: --section.key options change the recipe of --config"):
        load_checkpoint(tmp_path / "tt", overrides=["--model.n_layers", "2"])
    with pytest.raises(ConfigError, match=r"training.steps is not read by convert \(it converts weights"):
        load_checkpoint(tmp_path / "tt", config=recipe, overrides=["--training.steps", "3"])


@pytest.mark.slow
def test_hf_folder_without_config_json(trained_debug, tmp_path):
    """torchtitan's own HF save writes only safetensors (+ index): --flavor says which model, or the shapes do."""
    convert_checkpoint(trained_debug["folder"], tmp_path / "hf", dst_format="hf")
    (tmp_path / "hf" / "config.json").unlink()
    assert detect(tmp_path / "hf") == "hf"
    with pytest.raises(CheckpointError, match="lacks tensor.*layers.2.*--flavor debugmodel"):
        load_checkpoint(tmp_path / "hf", flavor="debugmodel")  # the flavor has 6 layers, the weights 2
    report = convert_checkpoint(tmp_path / "hf", tmp_path / "back", dst_format="dcp")
    assert "flavor debugmodel's with 2 layers" in report.origin
    assert_same(load_checkpoint(tmp_path / "back")[0], trained_debug["state"])
    recipe = tmp_path / "two_layers.toml"
    recipe.write_text('[model]\nflavor = "debugmodel"\nn_layers = 2\n[training]\nseq_len = 64\n')
    sd, args = load_checkpoint(tmp_path / "hf", config=recipe)
    assert args.n_layers == 2
    assert_same(sd, trained_debug["state"])


def test_dcp_output_of_a_torchtitan_source_carries_no_step(trained_debug, tmp_path):
    write_torchtitan(tmp_path / "tt", trained_debug["state"], full=True)
    convert_checkpoint(tmp_path / "tt", tmp_path / "dcp")
    meta = json.loads((tmp_path / "dcp" / "titanctl.json").read_text())
    assert meta["step"] == 0 and meta["converted_from"] == "torchtitan" and meta["weights_only"] is True


# torchtitan's own debugmodel (0.2 and 0.3: torchtitan/models/llama3/__init__.py): dim 256, 16 heads of 16,
# 6 layers, MLP 768, RoPE theta 5e5 with Llama 3.1 scaling, n_kv_heads unset (multi-head attention), and its
# test tokenizer's 2048 tokens: titanctl's flavor debugmodel_torchtitan. titanctl's debugmodel has the same
# widths in 8 heads of 32, 2 of them key/value.
TORCHTITAN_DEBUGMODEL = LLAMA3_FLAVORS["debugmodel_torchtitan"].replace(vocab_size=2048)
# titanctl's own debugmodel flavor at the same vocabulary: what --flavor debugmodel means.
TITANCTL_DEBUGMODEL = LLAMA3_FLAVORS["debugmodel"].replace(vocab_size=2048)


def random_state(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return build_model(args).state_dict()


@pytest.fixture(scope="module")
def torchtitan_debugmodel():
    return random_state(TORCHTITAN_DEBUGMODEL, 1)


@pytest.fixture(scope="module")
def titanctl_debugmodel():
    return random_state(TITANCTL_DEBUGMODEL, 2)


def write_configless(folder, state, args, fmt: str) -> None:
    """A checkpoint folder that says nothing of its model: torchtitan's DCP, or HF safetensors alone."""
    if fmt == "torchtitan":
        write_torchtitan(folder, state, full=True)
    else:
        save_state_dict(state, args, folder, "hf")
        (folder / "config.json").unlink()


def recipe_file(tmp_path, text: str):
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("full", [False, True], ids=["weights-only", "full"])
@pytest.mark.slow
def test_torchtitans_own_debugmodel_converts_to_hf_and_matches_transformers(
    torchtitan_debugmodel, transformers, tmp_path, full
):
    step = tmp_path / "step-10"
    write_torchtitan(step, torchtitan_debugmodel, full=full)
    assert stored(step)["layers.0.attention.qkv_linear.wk.weight"].size == torch.Size([256, 256])
    report = convert_checkpoint(step, tmp_path / "hf", dst_format="hf")
    # titanctl's debugmodel has the same widths but for the key/value width: the flavor whose key/value width
    # is the checkpoint's too is taken, with its 16 heads of 16.
    assert report.origin == (
        "tensor shapes (dim 256, 6 layers, vocab 2048, query width 256, key/value width 256, ffn 768: flavor "
        "debugmodel_torchtitan's; n_heads 16, n_kv_heads 16, RoPE and norm eps taken from it)"
    )
    assert report.args == TORCHTITAN_DEBUGMODEL.replace(max_seq_len=report.args.max_seq_len)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_key_value_heads"] == 16
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ours = build_model(TORCHTITAN_DEBUGMODEL).eval()
    ours.load_state_dict(torchtitan_debugmodel)
    ids = torch.randint(0, 2048, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(ids)
        delta = (want - theirs(ids).logits).abs().max().item()
    assert want.abs().max() > 1.0  # logits far from zero: a wrong layout could not pass unseen
    assert delta <= 1e-4, delta
    assert_same(load_checkpoint(tmp_path / "hf")[0], torchtitan_debugmodel)


@pytest.mark.parametrize("fmt", ["torchtitan", "hf"])
def test_the_flavor_of_other_kv_heads_is_refused_saying_what_to_set(torchtitan_debugmodel, tmp_path, fmt):
    """titanctl's debugmodel flavor has 2 key/value heads of 32, torchtitan's debugmodel 16 of 16: the error
    names the flavor whose key/value width the checkpoint has."""
    write_configless(tmp_path / "in", torchtitan_debugmodel, TORCHTITAN_DEBUGMODEL, fmt)
    with pytest.raises(CheckpointError, match=r"(k|v)_proj\.weight|qkv_linear\.w[kv]\.weight") as error:
        load_checkpoint(tmp_path / "in", flavor="debugmodel")
    assert "has shape (256, 256), expected (64, 256) for " in str(error.value)
    assert ("the checkpoint has flavor debugmodel_torchtitan's key/value width (16 heads of 16); use that flavor "
            "(model.flavor, or convert's --flavor)") in str(error.value)
    assert "--flavor debugmodel" in str(error.value)


@pytest.mark.parametrize("fmt", ["torchtitan", "hf"])
@pytest.mark.slow
def test_flavor_reads_a_folder_without_config(titanctl_debugmodel, tmp_path, fmt):
    write_configless(tmp_path / "in", titanctl_debugmodel, TITANCTL_DEBUGMODEL, fmt)
    report = convert_checkpoint(tmp_path / "in", tmp_path / "dcp", flavor="debugmodel", dst_format="dcp")
    assert report.origin == "--flavor debugmodel"
    assert report.args == LLAMA3_FLAVORS["debugmodel"].replace(vocab_size=2048)  # vocabulary from the embedding
    sd, args = load_checkpoint(tmp_path / "dcp")
    assert args == report.args
    assert_same(sd, titanctl_debugmodel)


@pytest.mark.parametrize("fmt", ["torchtitan", "hf"])
@pytest.mark.slow
def test_config_reads_a_folder_without_config(torchtitan_debugmodel, tmp_path, fmt):
    write_configless(tmp_path / "in", torchtitan_debugmodel, TORCHTITAN_DEBUGMODEL, fmt)
    recipe = recipe_file(tmp_path, '[model]\nflavor = "debugmodel_torchtitan"\n[training]\nseq_len = 128\n')
    report = convert_checkpoint(tmp_path / "in", tmp_path / "dcp", config=recipe, dst_format="dcp")
    assert report.origin == f"--config {recipe}"
    assert report.args == TORCHTITAN_DEBUGMODEL.replace(max_seq_len=128)
    sd, args = load_checkpoint(tmp_path / "dcp")
    assert args == report.args
    assert_same(sd, torchtitan_debugmodel)


# ---------------------------------------------------------------------------- Qwen3, Qwen3-MoE, DeepSeek-V3


def torchtitan_03_state_dict(args: ModelArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    """torchtitan 0.3.0's model state dict for the model ``args``: its name -> (titanctl's name, shape).

    Written from torchtitan 0.3.0's source, module by module (not from titanctl's name tables):
    ``models/common/decoder.py`` Decoder (tok_embeddings, layers, norm, lm_head) and TransformerBlock
    (attention, feed_forward or moe, attention_norm, ffn_norm); ``models/common/attention.py``
    GQAttention (qkv_linear, wo, q_norm, k_norm; FusedQKVLinear saves its wqkv split into
    qkv_linear.wq/wk/wv); ``models/deepseek_v3/model.py`` Attention (MLA: wq or wq_a/q_norm/wq_b,
    wkv_a, kv_norm, wkv_b, wo); ``models/common/feed_forward.py`` FeedForward (w1, w2, w3);
    ``models/common/moe.py`` MoE (router.gate, routed_experts.inner_experts.w1_EFD [E, F, D],
    w2_EDF [E, D, F], w3_EFD [E, F, D], shared_experts, the persistent buffer expert_bias_E);
    ``models/deepseek_v3/mtp.py`` MTPTransformerBlock (mtp_layers.{k}: a block plus enorm, hnorm,
    eh_proj [D, 2D], mtp_norm); ``models/gpt_oss/model.py`` Attention (sinks [H]; its FusedQKVLinear
    splits the bias too: qkv_linear.wq/wk/wv.bias; wo with a bias), ``models/gpt_oss/moe.py``
    GptOssGroupedExperts (mlp1_weight_EGD [E, 2F, D], mlp1_bias_EG [E, 2F], mlp2_weight_EDF [E, D, F],
    mlp2_bias_ED [E, D]) and its router's gate with a bias (``models/gpt_oss/__init__.py``).
    """
    d, hd, vocab, heads = args.dim, args.head_dim, args.vocab_size, args.n_heads
    table = {"tok_embeddings.weight": ("tok_embeddings.weight", (vocab, d)), "norm.weight": ("norm.weight", (d,)),
             "lm_head.weight": ("output.weight", (vocab, d))}

    def block(theirs: str, ours: str, layer_id: int) -> None:
        def add(their_name: str, our_name: str, shape: tuple[int, ...]) -> None:
            table[theirs + their_name] = (ours + our_name, shape)

        if args.mla is None:
            for w, n in (("wq", heads), ("wk", args.kv_heads), ("wv", args.kv_heads)):
                add(f"attention.qkv_linear.{w}.weight", f"attention.{w}.weight", (n * hd, d))
            add("attention.wo.weight", "attention.wo.weight", (d, heads * hd))
            if args.attention_bias:
                for w, n in (("wq", heads), ("wk", args.kv_heads), ("wv", args.kv_heads)):
                    add(f"attention.qkv_linear.{w}.bias", f"attention.{w}.bias", (n * hd,))
                add("attention.wo.bias", "attention.wo.bias", (d,))
            if args.attention_sinks:
                add("attention.sinks", "attention.sinks", (heads,))
            if args.qk_norm:
                add("attention.q_norm.weight", "attention.q_norm.weight", (hd,))
                add("attention.k_norm.weight", "attention.k_norm.weight", (hd,))
        else:
            mla = args.mla
            qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
            if mla.q_lora_rank:
                add("attention.wq_a.weight", "attention.wq_a.weight", (mla.q_lora_rank, d))
                add("attention.q_norm.weight", "attention.q_norm.weight", (mla.q_lora_rank,))
                add("attention.wq_b.weight", "attention.wq_b.weight", (heads * qk, mla.q_lora_rank))
            else:
                add("attention.wq.weight", "attention.wq.weight", (heads * qk, d))
            add("attention.wkv_a.weight", "attention.wkv_a.weight", (mla.kv_lora_rank + mla.qk_rope_head_dim, d))
            add("attention.kv_norm.weight", "attention.kv_norm.weight", (mla.kv_lora_rank,))
            add("attention.wkv_b.weight", "attention.wkv_b.weight",
                (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank))
            add("attention.wo.weight", "attention.wo.weight", (d, heads * mla.v_head_dim))
        if args.is_moe_layer(layer_id) and args.moe.expert_kind == "clamped_swiglu":
            e, f = args.moe.num_experts, args.moe.hidden_dim
            add("moe.router.gate.weight", "moe.router.gate.weight", (e, d))
            add("moe.router.gate.bias", "moe.router.gate.bias", (e,))
            add("moe.routed_experts.inner_experts.mlp1_weight_EGD", "moe.experts.w13", (e, 2 * f, d))
            add("moe.routed_experts.inner_experts.mlp1_bias_EG", "moe.experts.b13", (e, 2 * f))
            add("moe.routed_experts.inner_experts.mlp2_weight_EDF", "moe.experts.w2", (e, d, f))
            add("moe.routed_experts.inner_experts.mlp2_bias_ED", "moe.experts.b2", (e, d))
            add("moe.expert_bias_E", "moe.expert_bias", (e,))
        elif args.is_moe_layer(layer_id):
            e, f = args.moe.num_experts, args.moe.hidden_dim
            add("moe.router.gate.weight", "moe.router.gate.weight", (e, d))
            add("moe.routed_experts.inner_experts.w1_EFD", "moe.experts.w1", (e, f, d))
            add("moe.routed_experts.inner_experts.w2_EDF", "moe.experts.w2", (e, d, f))
            add("moe.routed_experts.inner_experts.w3_EFD", "moe.experts.w3", (e, f, d))
            add("moe.expert_bias_E", "moe.expert_bias", (e,))
            if args.moe.num_shared_experts:
                shared = f * args.moe.num_shared_experts
                for w, shape in (("w1", (shared, d)), ("w2", (d, shared)), ("w3", (shared, d))):
                    add(f"moe.shared_experts.{w}.weight", f"moe.shared_experts.{w}.weight", shape)
        else:
            f = args.ffn_hidden_dim
            for w, shape in (("w1", (f, d)), ("w2", (d, f)), ("w3", (f, d))):
                add(f"feed_forward.{w}.weight", f"feed_forward.{w}.weight", shape)
        add("attention_norm.weight", "attention_norm.weight", (d,))
        add("ffn_norm.weight", "ffn_norm.weight", (d,))

    for i in range(args.n_layers):
        block(f"layers.{i}.", f"layers.{i}.", i)
    for k in range(args.mtp_layers):  # titanctl keeps a depth's block after the main ones, its own four apart
        block(f"mtp_layers.{k}.", f"layers.{args.n_layers + k}.", args.n_layers + k)
        for theirs, ours, shape in (("enorm", "enorm", (d,)), ("hnorm", "hnorm", (d,)), ("eh_proj", "eh_proj", (d, 2 * d)),
                                    ("mtp_norm", "norm", (d,))):
            table[f"mtp_layers.{k}.{theirs}.weight"] = (f"mtp.{k}.{ours}.weight", shape)
    return table


def family_case(case: str) -> tuple[ModelArgs, str | None, list[str]]:
    """A tiny model of the case, and the family's recipe plus the overrides that describe it (None: no recipe can)."""
    from titanctl.models.registry import get_spec

    family = case.split(":")[0]
    layers, depths = (3, 1) if family == "deepseek_v3" else (2, 0)  # DeepSeek-V3: 1 dense layer, 2 MoE, 1 depth
    args = get_spec(family).flavors["debugmodel"].replace(n_layers=layers, mtp_layers=depths, vocab_size=300,
                                                          max_seq_len=32)
    overrides = ["--model.n_layers", str(layers), "--training.seq_len", "32"]
    overrides += ["--model.mtp_layers", str(depths)] if depths else []
    if case == "deepseek_v3:q_lora_rank=0":  # torchtitan's own DeepSeek-V3 debugmodel and 16B: queries from wq
        return args.replace(mla=dataclasses.replace(args.mla, q_lora_rank=0)), None, []
    return args, str(REPO / "recipes" / f"{family}_debug.toml"), overrides


def random_weights(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor random (norms and the expert bias too: a swapped name cannot pass), a tied output the embedding."""
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in build_model(args).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    state = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state


def read_stored(folder) -> dict[str, torch.Tensor]:
    out = {k: torch.empty(e.size, dtype=e.properties.dtype) for k, e in stored(folder).items()}
    dcp.load(out, checkpoint_id=str(folder), no_dist=True)
    return out


def read_back(folder, **kwargs) -> tuple[dict[str, torch.Tensor], ModelArgs, str, list[str]]:
    """What titanctl reads from a folder: (canonical state dict, model, where the model came from, notes)."""
    with open_checkpoint(folder, **kwargs) as source:
        return dict(source.iter_tensors()), source.args, source.origin, source.notes


@pytest.mark.parametrize("case", ["qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v3:q_lora_rank=0", "gpt_oss"])
def test_families_go_to_torchtitan_03s_names_and_back_bit_for_bit(case, tmp_path):
    """titanctl -> torchtitan writes exactly torchtitan 0.3.0's state dict (names, shapes, bits) and reads it
    back; torchtitan's own full save of it (no config) comes back through --config and overrides."""
    args, recipe, overrides = family_case(case)
    state = random_weights(args, seed=0)
    table = torchtitan_03_state_dict(args)
    assert sorted(ours for ours, _ in table.values()) == sorted(state)  # the table covers the model, once each
    want = {k: v for k, v in state.items() if not (args.tie_embeddings and k == "output.weight")}  # read: tie dropped

    save_state_dict(state, args, tmp_path / "tt", "torchtitan")  # convert --to torchtitan's writer
    assert {k: tuple(e.size) for k, e in stored(tmp_path / "tt").items()} == {k: s for k, (_, s) in table.items()}
    written = read_stored(tmp_path / "tt")
    assert [theirs for theirs, (ours, _) in table.items() if not torch.equal(written[theirs], state[ours])] == []
    got, got_args, origin, _ = read_back(tmp_path / "tt")
    assert origin == "config.json" and got_args == args.replace(max_seq_len=got_args.max_seq_len)
    assert_same(got, want)
    if recipe is None:
        return

    # torchtitan's own save (model and training state) holds no config: the recipe and its overrides say which model.
    model_sd = {theirs: state[ours] for theirs, (ours, _) in table.items()}
    dcp.save({**model_sd, **training_state(model_sd)}, checkpoint_id=str(tmp_path / "step-3"), no_dist=True)
    if args.moe is not None:  # dense Qwen3's shapes name its flavor; MoE shapes name none
        with pytest.raises(CheckpointError, match="n_heads cannot be inferred from shapes: give --flavor or --config"):
            load_checkpoint(tmp_path / "step-3")
    got, got_args, origin, notes = read_back(tmp_path / "step-3", config=recipe, overrides=overrides)
    assert origin == f"--config {recipe} {' '.join(overrides)}" and got_args == args
    assert notes[0].startswith("torchtitan 0.3 names (") and notes[1].startswith("full training checkpoint")
    assert_same(got, want)
    # titanctl's own names, as torchtitan <= 0.2 saved these modules, are read too.
    write_torchtitan(tmp_path / "old", state, names="<=0.2")
    assert_same(read_back(tmp_path / "old", config=recipe, overrides=overrides)[0], want)


def test_every_family_in_torchtitans_format_has_its_names():
    from titanctl.models.registry import all_specs

    assert {spec.name: "torchtitan" in spec.formats for spec in all_specs()} == {
        spec.name: spec.torchtitan is not None for spec in all_specs()}

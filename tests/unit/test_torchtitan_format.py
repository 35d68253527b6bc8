"""torchtitan checkpoints both ways: 0.3 and <= 0.2 names, weights-only and full training checkpoints,
models without a config (from --flavor, --config or inferred from shapes, torchtitan's own multi-head
debugmodel included), and HF folders without config.json.

The torchtitan folders here are written by the test itself with DCP, as torchtitan 0.3's
CheckpointManager lays them out: the model state dict flat at the top level, beside the
optimizer, lr_scheduler, dataloader and train_state entries of a full checkpoint.
"""

from __future__ import annotations

import json
import pickle
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.unit.trained_model import loss_of
from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint, open_checkpoint, save_state_dict
from titanctl.checkpoint.formats import detect
from titanctl.errors import CheckpointError
from titanctl.models.llama.args import LLAMA3_FLAVORS, ModelArgs
from titanctl.models.llama.model import Transformer

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
    ours = Transformer(trained_debug["args"])
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
    state = Transformer(args).state_dict()
    write_torchtitan(tmp_path / "tt", state, full=True)
    with pytest.raises(CheckpointError, match=r"tensor shapes say dim 64, 2 layers, vocab 300, query width 64, "
                                              r"key/value width 16, ffn 256.*n_heads cannot be inferred.*--flavor"):
        load_checkpoint(tmp_path / "tt")
    recipe = tmp_path / "tiny.toml"
    recipe.write_text('[model]\nflavor = "debugmodel"\nn_layers = 2\n')
    with pytest.raises(CheckpointError, match=r"has shape \(300, 64\), expected \(300, 256\) for the model from --config"):
        load_checkpoint(tmp_path / "tt", config=recipe)


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


# torchtitan's own debugmodel (0.2 and 0.3: torchtitan/models/llama3/__init__.py): titanctl's debugmodel
# shape (dim 256, 16 heads, 6 layers, MLP 768, RoPE theta 5e5 with Llama 3.1 scaling), but n_kv_heads
# unset, i.e. multi-head attention with 16 key/value heads, and its test tokenizer's 2048 tokens.
TORCHTITAN_DEBUGMODEL = LLAMA3_FLAVORS["debugmodel"].replace(n_kv_heads=16, vocab_size=2048)
# titanctl's own debugmodel flavor at the same vocabulary: what --flavor debugmodel means.
TITANCTL_DEBUGMODEL = LLAMA3_FLAVORS["debugmodel"].replace(vocab_size=2048)


def random_state(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return Transformer(args).state_dict()


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
    # The shapes are titanctl's debugmodel but for the key/value width: 16 heads, as many as the queries.
    assert report.origin == (
        "tensor shapes (dim 256, 6 layers, vocab 2048, query width 256, key/value width 256, ffn 768: flavor "
        "debugmodel's; n_heads 16, RoPE and norm eps taken from it; n_kv_heads 16 from the key/value width "
        "(multi-head attention, where the flavor has 4))"
    )
    assert report.args == TORCHTITAN_DEBUGMODEL.replace(max_seq_len=report.args.max_seq_len)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_key_value_heads"] == 16
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ours = Transformer(TORCHTITAN_DEBUGMODEL).eval()
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
    """titanctl's debugmodel flavor has 4 key/value heads, torchtitan's debugmodel 16: the error says how
    many the checkpoint has, and which setting says so (--config with model.n_kv_heads, as tested below)."""
    write_configless(tmp_path / "in", torchtitan_debugmodel, TORCHTITAN_DEBUGMODEL, fmt)
    with pytest.raises(CheckpointError, match=r"(k|v)_proj\.weight|qkv_linear\.w[kv]\.weight") as error:
        load_checkpoint(tmp_path / "in", flavor="debugmodel")
    assert "has shape (256, 256), expected (64, 256) for " in str(error.value)
    assert "the checkpoint has 16 key/value heads of 16, the model 4; set model.n_kv_heads = 16" in str(error.value)
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
    recipe = recipe_file(tmp_path, '[model]\nflavor = "debugmodel"\nn_kv_heads = 16\n[training]\nseq_len = 128\n')
    report = convert_checkpoint(tmp_path / "in", tmp_path / "dcp", config=recipe, dst_format="dcp")
    assert report.origin == f"--config {recipe}"
    assert report.args == TORCHTITAN_DEBUGMODEL.replace(max_seq_len=128)
    sd, args = load_checkpoint(tmp_path / "dcp")
    assert args == report.args
    assert_same(sd, torchtitan_debugmodel)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_moe_families_go_to_torchtitan_under_its_module_names_and_back(family, tmp_path):
    """torchtitan's MoE (``moe.router.gate``, stacked ``moe.experts.w1/w2/w3``, ``moe.shared_experts``,
    the ``moe.expert_bias`` buffer) and latent attention (``attention.wq_a`` ... ``wkv_b``) are titanctl's
    names: written flat as torchtitan saves them, read back bit for bit (the expert bias included)."""
    from titanctl.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS
    from titanctl.models.qwen3_moe.args import QWEN3_MOE_FLAVORS

    flavors = {"qwen3_moe": QWEN3_MOE_FLAVORS, "deepseek_v3": DEEPSEEK_V3_FLAVORS}
    args = flavors[family]["debugmodel"].replace(n_layers=2, vocab_size=300, max_seq_len=32)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(torch.randn(buffer.shape))
    state = model.state_dict()
    save_state_dict(state, args, tmp_path / "dcp")
    convert_checkpoint(tmp_path / "dcp", tmp_path / "tt", dst_format="torchtitan")
    assert set(stored(tmp_path / "tt")) == set(state)
    assert "layers.1.moe.experts.w1" in state and "layers.1.moe.router.gate.weight" in state
    back = convert_checkpoint(tmp_path / "tt", tmp_path / "back", dst_format="dcp")
    assert back.origin == "config.json" and back.args == args.replace(max_seq_len=back.args.max_seq_len)
    loaded, _ = load_checkpoint(tmp_path / "back")
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)

"""`titanctl convert-checkpoint` / `titanctl convert` run as a user runs them: a subprocess, offline."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.cli_server import titanctl_run
from tests.conftest import OFFLINE_ENV, REPO
from titanctl.checkpoint.convert import load_checkpoint, save_state_dict
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.decoder import Transformer

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, max_seq_len=32)


def run(*args, check=True):
    proc = titanctl_run([*map(str, args)], env={**os.environ, **OFFLINE_ENV}, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def meta_ckpt(tmp_path_factory):
    torch.manual_seed(0)
    state = Transformer(ARGS).state_dict()
    folder = tmp_path_factory.mktemp("cli") / "meta"
    save_state_dict(state, ARGS, folder, "meta")
    return folder, state


def test_convert_checkpoint_and_its_alias_infer_formats(meta_ckpt, tmp_path):
    src, state = meta_ckpt
    proc = run("convert-checkpoint", src, tmp_path / "hf", "--to", "hf", "--dtype", "bf16")
    assert proc.stdout.startswith("meta → hf: 21 tensors"), proc.stdout  # --from told by params.json + .pth
    assert "model from params.json" in proc.stdout
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    proc = run("convert", tmp_path / "hf", tmp_path / "dcp")  # the alias; hf -> dcp by default
    assert proc.stdout.startswith("hf → dcp:"), proc.stdout
    back, args = load_checkpoint(tmp_path / "dcp")
    assert args.n_layers == 2 and args.vocab_size == 300
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor.to(torch.bfloat16)), name


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "does not exist"),
        ("wrong-format", "has no *.safetensors weights"),
        ("unknown-format", "cannot tell the checkpoint format"),
        ("non-empty-dst", "is not empty: refusing to overwrite"),
        ("flavor", "has shape (300, 64), expected (300, 4096) for the model from --flavor 8B"),
        ("torchtitan-shapes", "n_heads cannot be inferred from shapes: give --flavor or --config"),
        ("tokenizer-vocab", "has 4352 tokens but the model's vocabulary is 300"),
        ("text-only-to-dcp", "--text-only applies to --to hf only"),
    ],
)
def test_bad_input_is_one_red_line_and_exit_2(meta_ckpt, tmp_path, case, message):
    src, _ = meta_ckpt
    dst = tmp_path / "out"
    args = [src, dst]
    if case == "missing":
        args = [tmp_path / "no-such-folder", dst]
    elif case == "wrong-format":
        args += ["--from", "hf"]
    elif case == "unknown-format":
        (tmp_path / "notes").mkdir()
        (tmp_path / "notes" / "readme.txt").write_text("not a checkpoint")
        args = [tmp_path / "notes", dst]
    elif case == "non-empty-dst":
        dst.mkdir()
        (dst / "keep.txt").write_text("mine")
    elif case == "flavor":
        args += ["--flavor", "8B"]
    elif case == "torchtitan-shapes":
        run("convert", src, tmp_path / "tt", "--to", "torchtitan")
        (tmp_path / "tt" / "params.json").unlink()  # a torchtitan folder as torchtitan writes it: no config
        args = [tmp_path / "tt", dst]
    elif case == "tokenizer-vocab":
        args += ["--to", "hf", "--tokenizer-path", REPO / "titanctl" / "assets" / "tokenizer" / "tokenizer.model"]
    elif case == "text-only-to-dcp":
        args += ["--to", "dcp", "--text-only"]
    proc = run("convert", *args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    if case == "non-empty-dst":
        assert [p.name for p in dst.iterdir()] == ["keep.txt"]
    else:
        assert not dst.exists()
    assert not list(tmp_path.glob(".*partial*"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torchtitan_training_checkpoint_to_hf_says_what_it_ignored(tmp_path):
    import torch.distributed.checkpoint as dcp

    from titanctl.models.llama.args import LLAMA3_FLAVORS
    torch.manual_seed(0)
    state = Transformer(LLAMA3_FLAVORS["debugmodel"].replace(n_layers=1, vocab_size=300)).state_dict()
    step = tmp_path / "step-3"  # torchtitan 0.3's layout: the model flat at the top level, under 0.3's names
    renamed = {"lm_head.weight" if k == "output.weight" else k.replace(".attention.w", ".attention.qkv_linear.w")
               if k.split(".")[-2] in ("wq", "wk", "wv") else k: v for k, v in state.items()}
    dcp.save({**renamed, "optimizer": {"state": {"x": torch.zeros(2)}}, "lr_scheduler": {"last_epoch": 3},
              "dataloader": {"dp_rank_0": b"\x80"}, "train_state": {"step": 3}}, checkpoint_id=str(step), no_dist=True)
    proc = run("convert", step, tmp_path / "hf", "--to", "hf")
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("torchtitan → hf: 12 tensors"), proc.stdout
    assert "model from tensor shapes (dim 256, 1 layers, vocab 300" in lines[0]
    assert "flavor debugmodel's with 1 layers; n_heads 8, n_kv_heads 2" in lines[0]
    assert lines[1:] == [
        "  note: torchtitan 0.3 names (attention.qkv_linear.*, lm_head)",
        "  note: full training checkpoint: model weights taken; dataloader, lr_scheduler, optimizer, train_state "
        "ignored",
        "  note: no tokenizer files written: the checkpoint names no tokenizer and the model's vocabulary (300) is "
        "not the bundled tokenizer's (4352); give --tokenizer-path",
    ], proc.stdout
    back, _ = load_checkpoint(tmp_path / "hf")
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torchtitans_debugmodel_converts_and_the_console_says_what_was_inferred(tmp_path):
    """torchtitan's debugmodel is 16 heads of 16, all key/value (titanctl's debugmodel: 8 of 32, 2 key/value)."""
    import torch.distributed.checkpoint as dcp

    from titanctl.models.llama.args import LLAMA3_FLAVORS
    args = LLAMA3_FLAVORS["debugmodel_torchtitan"].replace(n_layers=1, vocab_size=300)
    torch.manual_seed(0)
    state = Transformer(args).state_dict()
    step = tmp_path / "step-1"
    dcp.save({"lm_head.weight" if k == "output.weight" else k.replace(".attention.w", ".attention.qkv_linear.w")
              if k.split(".")[-2] in ("wq", "wk", "wv") else k: v for k, v in state.items()},
             checkpoint_id=str(step), no_dist=True)
    proc = run("convert", step, tmp_path / "hf", "--to", "hf")
    first = proc.stdout.splitlines()[0]
    assert "flavor debugmodel_torchtitan's with 1 layers; n_heads 16, n_kv_heads 16, RoPE and norm eps taken from " \
           "it" in first, proc.stdout
    # titanctl's debugmodel is not this model; the recipe with torchtitan's flavor is.
    proc = run("convert", step, tmp_path / "out", "--flavor", "debugmodel", check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "the checkpoint has flavor debugmodel_torchtitan's key/value width (16 heads of 16)" in proc.stderr
    # The family's recipe with command-line overrides, as train takes them.
    recipe = REPO / "recipes" / "llama3_debug.toml"
    proc = run("convert", step, tmp_path / "dcp", "--config", recipe, "--model.n_layers", "1",
               "--model.flavor", "debugmodel_torchtitan")
    assert f"model from --config {recipe} --model.n_layers 1 --model.flavor debugmodel_torchtitan" in proc.stdout, \
        proc.stdout
    for folder in ("hf", "dcp"):
        back, got = load_checkpoint(tmp_path / folder)
        assert got.kv_heads == 16
        for name, tensor in state.items():
            assert torch.equal(back[name], tensor), (folder, name)


def test_a_peft_adapter_converts_onto_its_base(tmp_path):
    """The adapter folder as peft writes it (here by titanctl's own --to peft writer, from random adapters)."""
    from titanctl.checkpoint.lora.export import write_peft
    from titanctl.config.job_config import LoRA
    from titanctl.parallel.converters.lora import apply_lora, is_adapter

    torch.manual_seed(0)
    model = Transformer(ARGS)
    save_state_dict(model.state_dict(), ARGS, tmp_path / "base")
    record = apply_lora(model, LoRA(rank=4, alpha=8.0, target_modules=["attention.wq", "attention.wv"])).record()
    (tmp_path / "adapter").mkdir()
    write_peft(tmp_path / "adapter", {n: p.detach() for n, p in model.named_parameters() if is_adapter(n)}, ARGS,
               record, None)
    proc = run("convert", tmp_path / "adapter", tmp_path / "step", "--from", "peft", "--lora-base", tmp_path / "base")
    assert proc.stdout.startswith("peft → dcp: 8 tensors"), proc.stdout  # A and B of wq and wv, 2 layers
    assert ("note: to train on: --lora.enable --lora.rank 4 --lora.alpha 8 --lora.target_modules "
            "attention.wq,attention.wv --checkpoint.initial_load_path OUT") in proc.stdout, proc.stdout
    assert json.loads((tmp_path / "step" / "titanctl.json").read_text())["lora"]["rank"] == 4
    proc = run("convert", tmp_path / "adapter", tmp_path / "again", check=False)  # told by its files; no base named
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and not (tmp_path / "again").exists()
    assert "--from peft reads an adapter onto the model it was made for: give --lora-base" in proc.stderr, proc.stderr

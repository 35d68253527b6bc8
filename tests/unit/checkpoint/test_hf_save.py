"""Hugging Face saves while training, in one process (no torchrun): the folder is what
`titanctl convert --to hf` makes of the same step's DCP checkpoint, byte for byte; transformers loads
it greedy by default; retention counts HF folders apart; a resume refuses HF-only folders."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from titanctl.checkpoint.convert import convert_checkpoint
from titanctl.checkpoint.run.load_plan import plan_load
from titanctl.config.recipe import load_config
from titanctl.errors import CheckpointError, ConfigError
from titanctl.train.trainer import Trainer

TINY = [
    "--model.n_layers", "2",
    "--training.seq_len", "32",
    "--training.global_batch_size", "4",
    "--training.local_batch_size", "4",
    "--training.steps", "4",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "2",
    "--activation_checkpoint.mode", "none",
    "--checkpoint.enable_checkpoint",
    "--checkpoint.interval", "2",
]
QWEN3_TIED = ["--model.name", "qwen3", "--model.flavor", "debugmodel"]


def config(out: Path, *extra: str):
    return load_config(None, [*TINY, "--job.dump_folder", str(out), *extra])


def train(out: Path, *extra: str) -> Trainer:
    trainer = Trainer(config(out, *extra))
    trainer.train()
    return trainer


def listing(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def assert_same_folder(ours: Path, converted: Path) -> None:
    """Every file byte for byte (safetensors included: same tensors, same order, same header)."""
    assert listing(ours) == listing(converted)
    for name in listing(converted):
        assert (ours / name).read_bytes() == (converted / name).read_bytes(), name


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """save_format both, keep 1: the folder ends with step-4 and step-4-hf."""
    out = tmp_path_factory.mktemp("hf_save_llama")
    trainer = train(out, "--checkpoint.save_format", "both", "--checkpoint.keep_latest_k", "1")
    return out / "checkpoint", trainer


def test_both_formats_with_retention_counted_apart(llama_run):
    root, _ = llama_run
    assert listing(root) == {"step-4", "step-4-hf"}  # step-2 and step-2-hf went, no temporary folder stays


def test_hf_save_is_what_convert_writes_from_the_same_step(llama_run, tmp_path):
    root, _ = llama_run
    convert_checkpoint(root / "step-4", tmp_path / "converted", dst_format="hf")
    assert_same_folder(root / "step-4-hf", tmp_path / "converted")


def test_transformers_loads_it_with_the_logits_of_the_converted_step(llama_run, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    import transformers

    root, _ = llama_run
    convert_checkpoint(root / "step-4", tmp_path / "converted", dst_format="hf")
    ids = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = []
    for folder in (root / "step-4-hf", tmp_path / "converted"):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        assert type(model).__name__ == "LlamaForCausalLM"
        assert model.generation_config.do_sample is False
        with torch.no_grad():
            logits.append(model(ids).logits)
        generation = json.loads((folder / "generation_config.json").read_text())
        assert generation["do_sample"] is False and generation["bos_token_id"] == 4096
    assert (logits[0] - logits[1]).abs().max().item() <= 1e-5


def test_hf_save_matches_the_live_weights(llama_run):
    root, trainer = llama_run
    saved = load_file(root / "step-4-hf" / "model.safetensors")
    params = dict(trainer.model_parts[0].named_parameters())
    assert torch.equal(saved["model.embed_tokens.weight"], params["tok_embeddings.weight"].detach())
    assert torch.equal(saved["model.layers.1.mlp.down_proj.weight"], params["layers.1.feed_forward.w2.weight"].detach())
    assert torch.equal(saved["lm_head.weight"], params["output.weight"].detach())


def test_a_failed_write_leaves_no_folder_and_says_why(llama_run, monkeypatch):
    root, trainer = llama_run

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("titanctl.checkpoint.formats.hf.save_file", disk_full)
    with pytest.raises(CheckpointError, match=r"step-9-hf failed: OSError: \[Errno 28\] No space left on device"):
        trainer.checkpoint.save_hf(9)
    assert listing(root) == {"step-4", "step-4-hf"}


def test_qwen3_tied_last_save_writes_no_lm_head_and_the_source_config(tmp_path):
    """Only the final step in HF (save_format dcp): the tied output layer is the embedding, stored once.
    The run starts from a folder transformers saved: its config.json comes back (documented keys aside),
    through the DCP step too."""

    from tests.unit.models.families import qwen3_model
    from titanctl.checkpoint.hf.carried_config import CHANGED_KEYS
    from titanctl.data.tokenizer import Tokenizer
    from titanctl.models.registry import model_args_from_config

    cfg = config(tmp_path / "run", *QWEN3_TIED)
    args = model_args_from_config(cfg.model, Tokenizer().vocab_size, cfg.training.seq_len)
    qwen3_model(args.replace(max_seq_len=512)).save_pretrained(tmp_path / "hf")  # not 40960, nor 32
    train(tmp_path / "run", *QWEN3_TIED, "--training.steps", "2", "--checkpoint.last_save_in_hf",
          "--checkpoint.keep_latest_k", "0", "--checkpoint.initial_load_path", str(tmp_path / "hf"))
    root = tmp_path / "run" / "checkpoint"
    assert listing(root) == {"step-2", "step-2-hf"}
    saved = load_file(root / "step-2-hf" / "model.safetensors")
    assert "lm_head.weight" not in saved and "model.embed_tokens.weight" in saved
    source, written = (json.loads((f / "config.json").read_text()) for f in (tmp_path / "hf", root / "step-2-hf"))
    assert written["tie_word_embeddings"] is True and written["max_position_embeddings"] == 512
    assert {k for k in source.keys() | written.keys() if source.get(k) != written.get(k)} <= CHANGED_KEYS.keys()
    convert_checkpoint(root / "step-2", tmp_path / "converted", dst_format="hf")
    assert_same_folder(root / "step-2-hf", tmp_path / "converted")


def test_resume_refuses_a_folder_of_hf_saves_only(llama_run, tmp_path):
    root, _ = llama_run
    shutil.copytree(root / "step-4-hf", tmp_path / "checkpoint" / "step-4-hf")
    cfg = config(tmp_path, "--checkpoint.save_format", "hf")
    with pytest.raises(CheckpointError, match=r"holds only Hugging Face saves \(newest step-4-hf\).*initial_load_path"):
        Trainer(cfg)


def test_resume_from_dcp_says_newer_hf_saves_are_weights_only(llama_run, tmp_path):
    root, trainer = llama_run
    shutil.copytree(root / "step-4", tmp_path / "checkpoint" / "step-4")
    shutil.copytree(root / "step-4-hf", tmp_path / "checkpoint" / "step-6-hf")
    plan = plan_load(config(tmp_path, "--training.steps", "8"), trainer.model_args)
    assert plan.step == 4
    assert any("step-6-hf" in note and "cannot resume" in note for note in plan.notes), plan.notes


def test_an_hf_save_is_a_valid_initial_load_path(llama_run, tmp_path):
    root, trainer = llama_run
    cfg = config(tmp_path, "--checkpoint.initial_load_path", str(root / "step-4-hf"))
    plan = plan_load(cfg, trainer.model_args)
    plan.source.close()
    assert (plan.format, plan.step) == ("hf", 0)


@pytest.mark.parametrize("extra, key", [
    (["--checkpoint.last_save_in_hf"], "checkpoint.last_save_in_hf"),
    (["--checkpoint.save_format", "hf"], "checkpoint.save_format"),
])
def test_hf_saves_need_checkpointing(tmp_path, extra, key):
    args = [a for a in TINY if a != "--checkpoint.enable_checkpoint"]
    with pytest.raises(ConfigError, match=f"'{key}' = .* needs checkpoint.enable_checkpoint = true"):
        load_config(None, [*args, "--job.dump_folder", str(tmp_path), *extra])

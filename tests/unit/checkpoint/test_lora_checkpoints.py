"""A LoRA run's checkpoints: adapters, optimizer and step only, with their base recorded (path and
fingerprint); a resume reproduces the uninterrupted run bit for bit; a missing or changed base is refused
in one line; what a LoRA run cannot start from or resume is refused before training.

The base is the session's trained run (tests/conftest.py): its step-2 folder (a titanctl step with a
checksum manifest) and its Hugging Face export (fingerprinted from the files' content).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from titanctl.checkpoint.lora.base import LoRAPlan
from titanctl.checkpoint.lora.export import read_adapters
from titanctl.checkpoint.run.load_plan import plan_load
from titanctl.checkpoint.trust.reader import DCPFolder
from titanctl.config.recipe import load_config
from titanctl.errors import CheckpointError, ConfigError
from titanctl.models.registry import model_args_from_config
from titanctl.models.shapes import weight_shapes
from titanctl.parallel.converters.lora import is_adapter
from titanctl.train.trainer import Trainer

LORA_RUN = [
    "--model.n_layers", "2",
    "--training.seq_len", "64",
    "--training.global_batch_size", "8",
    "--training.local_batch_size", "8",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "1",
    "--optimizer.lr", "3e-3",
    "--metrics.log_freq", "1",
    "--activation_checkpoint.mode", "none",
    "--lora.enable",
    "--lora.rank", "4",
    "--lora.target_modules", "attention,feed_forward",
    "--checkpoint.enable_checkpoint",
    "--checkpoint.interval", "2",
    "--checkpoint.keep_latest_k", "0",
]


def train(dump: Path, base: Path | None, steps: int, *extra: str) -> None:
    initial = ["--checkpoint.initial_load_path", str(base)] if base is not None else []
    cfg = load_config(None, [*LORA_RUN, *initial, "--training.steps", str(steps), "--job.dump_folder", str(dump),
                             *extra])
    Trainer(cfg).train()


def losses(dump: Path) -> dict[int, float]:
    """The last logged loss of each step (a resumed run logs its steps again)."""
    return {row["step"]: row["loss"] for row in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


@pytest.fixture(scope="module")
def base(trained_run) -> Path:
    return (trained_run / "checkpoint" / "step-2").resolve()


@pytest.fixture(scope="module")
def uninterrupted(base, tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("lora_uninterrupted")
    train(dump, base, 4)
    return dump


@pytest.mark.slow
def test_resume_is_bitwise_and_saves_hold_no_base_weight(base, uninterrupted, tmp_path):
    dump = tmp_path / "lora"
    step = dump / "checkpoint" / "step-2"
    shutil.copytree(uninterrupted / "checkpoint" / "step-2", step)  # as if it had stopped after step 2
    train(dump, base, 4)
    full, resumed = losses(uninterrupted), losses(dump)
    print(f"\nLORA resume: uninterrupted {full}, resumed {resumed}")
    assert sorted(resumed) == [3, 4] and all(resumed[s] == full[s] for s in (3, 4)), \
        "the resumed run's losses differ from the uninterrupted run's"
    # The adapters trained (B left zero), and only they: the base's weights are the base's.
    _, _, at2 = read_adapters(step)
    _, _, at4 = read_adapters(uninterrupted / "checkpoint" / "step-4")
    assert all(at2[n].abs().max() > 0 and not torch.equal(at2[n], at4[n]) for n in at2 if n.endswith("lora_b"))

    meta = json.loads((step / "titanctl.json").read_text())
    record = meta["lora"]
    assert record["rank"] == 4 and record["alpha"] == 16.0
    assert set(record["targets"]) == {f"layers.{i}.{m}" for i in range(2) for m in (
        "attention.wq", "attention.wk", "attention.wv", "attention.wo",
        "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}
    assert record["base"]["path"] == str(base) and record["base"]["format"] == "dcp"
    assert record["base"]["fingerprint"].startswith("sha256:manifest:")
    entries = DCPFolder(step).entries
    model_keys = {k for k in entries if k.split(".", 1)[0] not in (
        "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")}
    args = model_args_from_config(load_config(None, LORA_RUN).model, 4352, 64)
    base_weights = set(weight_shapes(args))
    assert model_keys and all(is_adapter(k) for k in model_keys), sorted(model_keys)[:5]
    assert not [k for k in entries if any(k.endswith(w) for w in base_weights)], "a base weight was saved"
    ratio = folder_bytes(step) / folder_bytes(base)
    print(f"LORA step folder {folder_bytes(step) / 1e3:.0f} kB, base folder {folder_bytes(base) / 1e6:.1f} MB "
          f"({100 * ratio:.2f}%)")
    assert ratio < 0.05


@pytest.mark.slow
def test_a_changed_or_missing_base_is_refused(foreign_formats, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(foreign_formats["hf"], base)
    dump = tmp_path / "lora"
    train(dump, base, 2)
    record = json.loads((dump / "checkpoint" / "step-2" / "titanctl.json").read_text())["lora"]["base"]
    assert record["format"] == "hf" and record["fingerprint"].startswith("sha256:files:")

    shard = next(base.glob("*.safetensors"))
    tensors = load_file(shard)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="is not the one the adapters of .*step-2 were trained on"):
        train(dump, None, 4)

    shutil.rmtree(base)
    with pytest.raises(CheckpointError, match=r"the LoRA base .*base \(recorded in .*titanctl.json\), which the "
                                              r"adapters of .*step-2 were trained on, is missing"):
        train(dump, None, 4)


@pytest.mark.slow
def test_the_base_may_move(foreign_formats, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(foreign_formats["hf"], base)
    dump = tmp_path / "lora"
    cfg = load_config(None, [*LORA_RUN, "--checkpoint.initial_load_path", str(base), "--training.steps", "2",
                             "--job.dump_folder", str(dump)])
    Trainer(cfg).train()
    moved = tmp_path / "moved"
    base.rename(moved)
    cfg = load_config(None, [*LORA_RUN, "--checkpoint.initial_load_path", str(moved), "--training.steps", "4",
                             "--job.dump_folder", str(dump)])
    plan = plan_load(cfg, model_args_from_config(cfg.model, 4352, 64))
    assert isinstance(plan, LoRAPlan) and plan.base.folder == moved and plan.own.step == 2
    assert plan.recorded["path"] == str(base.resolve())


@pytest.mark.parametrize("extra, error, message", [
    ([], ConfigError, "lora.enable needs checkpoint.initial_load_path"),
    (["--checkpoint.initial_load_path", "{base}", "--checkpoint.save_format", "both"], ConfigError,
     "a LoRA run saves its adapters only"),
    (["--checkpoint.initial_load_path", "{base}", "--checkpoint.last_save_in_hf"], ConfigError,
     "a LoRA run saves its adapters only"),
    (["--checkpoint.initial_load_path", "{base}", "--checkpoint.initial_load_model_weights_only", "false"],
     ConfigError, "takes only the base's weights"),
])
def test_settings_a_lora_run_cannot_have(base, tmp_path, extra, error, message):
    cfg = load_config(None, [*LORA_RUN, *(a.replace("{base}", str(base)) for a in extra),
                             "--job.dump_folder", str(tmp_path / "run")])
    with pytest.raises(error, match=message):
        plan_load(cfg, model_args_from_config(cfg.model, 4352, 64))


def test_what_a_lora_step_is_not(base, uninterrupted, tmp_path):
    step = uninterrupted / "checkpoint" / "step-2"
    args = ["--model.n_layers", "2", "--training.seq_len", "64", "--job.dump_folder", str(tmp_path / "run")]
    # A starting point only for a LoRA run of the same adapters (on the base it records).
    cfg = load_config(None, [*args, "--checkpoint.initial_load_path", str(step)])
    with pytest.raises(CheckpointError, match="holds LoRA adapters only .*--merge-lora"):
        plan_load(cfg, model_args_from_config(cfg.model, 4352, 64))
    cfg = load_config(None, [*args, "--lora.enable", "--checkpoint.initial_load_path", str(step)])
    with pytest.raises(CheckpointError, match="holds adapters of rank 4 on 14 modules, this run's lora settings make "
                                              "rank 8 on 8: train them on with lora.rank = 4 and lora.target_modules "
                                              "= attention.wk,attention.wo,attention.wq,attention.wv,feed_forward.w1,"):
        plan_load(cfg, model_args_from_config(cfg.model, 4352, 64))
    cfg = load_config(None, [*LORA_RUN, "--checkpoint.initial_load_path", str(step), "--job.dump_folder",
                             str(tmp_path / "run")])
    plan = plan_load(cfg, model_args_from_config(cfg.model, 4352, 64))
    assert (plan.start.folder, plan.own, plan.base.folder, plan.step) == (step, None, base, 0)
    # A run without lora does not resume it; a LoRA run does not resume a whole model's step.
    cfg = load_config(None, ["--model.n_layers", "2", "--job.dump_folder", str(uninterrupted),
                             "--checkpoint.enable_checkpoint"])
    with pytest.raises(CheckpointError, match="holds LoRA adapters .*resume it with lora.enable = true"):
        plan_load(cfg, model_args_from_config(cfg.model, 4352, 64))
    cfg = load_config(None, ["--model.n_layers", "2", "--job.dump_folder", str(base.parent.parent),
                             "--checkpoint.enable_checkpoint", "--lora.enable",
                             "--checkpoint.initial_load_path", str(base)])
    with pytest.raises(CheckpointError, match="holds a whole model, saved without lora"):
        plan_load(cfg, model_args_from_config(cfg.model, 4352, 64))
    # Another alpha would scale the same adapters differently.
    cfg = load_config(None, [*LORA_RUN, "--checkpoint.initial_load_path", str(base), "--lora.alpha", "8",
                             "--job.dump_folder", str(uninterrupted)])
    with pytest.raises(CheckpointError, match="trained with lora.alpha = 16, this run has 8"):
        plan_load(cfg, model_args_from_config(cfg.model, 4352, 64))

"""Checkpointing in one process (no torchrun): folder contract, resume, async, retention,
seed checkpoints, weights-only exports, initial_load_path, exclude_from_loading."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from titanctl.checkpoint.run.manager import complete_checkpoints
from titanctl.checkpoint.trust.metadata import model_args_from_metadata, read_metadata
from titanctl.config.recipe import load_config, to_toml
from titanctl.errors import CheckpointError, ConfigError
from titanctl.models.common.decoder import Transformer
from titanctl.train.trainer import Trainer

TINY = [
    "--model.n_layers", "2",
    "--training.seq_len", "64",
    "--training.global_batch_size", "8",
    "--training.local_batch_size", "8",
    "--training.steps", "4",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--activation_checkpoint.mode", "none",
    "--checkpoint.enable_checkpoint",
    "--checkpoint.interval", "2",
    "--checkpoint.keep_latest_k", "0",
]
TRAINING_STATE = ("optimizer", "lr_scheduler", "dataloader", "train_state", "rng")


def make(out: Path, *extra: str) -> Trainer:
    return Trainer(load_config(None, [*TINY, "--job.dump_folder", str(out), *extra]))


def train(out: Path, *extra: str) -> Trainer:
    trainer = make(out, *extra)
    trainer.train()
    return trainer


def losses(out: Path) -> dict[int, float]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return {}
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def read_dcp(folder: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = folder.parent / f"{folder.name}.pt"
    dcp_to_torch_save(str(folder), str(target))
    try:
        return torch.load(target, weights_only=False)
    finally:
        target.unlink()


def index_keys(folder: Path) -> dict:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(folder)).read_metadata().state_dict_metadata


def flat(state: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in state.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model_parts[0].state_dict().items()}


def copy_step(src: Path, step: int, dest: Path) -> Path:
    target = dest / "checkpoint" / f"step-{step}"
    shutil.copytree(src / "checkpoint" / f"step-{step}", target)
    return target


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """4 steps, saves at 2 and 4, all kept."""
    out = tmp_path_factory.mktemp("trained")
    trainer = train(out)
    return out, trainer, params(trainer)


@pytest.mark.slow
def test_step_folder_is_plain_dcp_with_the_metadata_contract(trained):
    out, trainer, final = trained
    assert sorted(complete_checkpoints(out / "checkpoint")) == [2, 4]
    folder = out / "checkpoint" / "step-4"
    assert {p.name for p in folder.iterdir()} == {".metadata", "__0_0.distcp", "titanctl.json", "config.toml"}
    meta = read_metadata(folder)
    assert (meta["step"], meta["weights_only"], meta["dtype"], meta["tokens_seen"]) == (4, False, "float32", 4 * 8 * 64)
    assert model_args_from_metadata(meta) == trainer.model_args
    assert to_toml(load_config(folder / "config.toml")) == to_toml(trainer.cfg)
    with torch.device("meta"):
        model_keys = set(Transformer(trainer.model_args).state_dict())
    keys = set(index_keys(folder))
    assert model_keys <= keys, "canonical model FQNs at the top level"
    assert {k.split(".", 1)[0] for k in keys - model_keys} == set(TRAINING_STATE)
    state = read_dcp(folder)  # torch's own DCP -> torch.save converter reads it
    for key, value in final.items():
        assert torch.equal(state[key], value), key
    assert state["train_state"]["step"] == 4 and state["dataloader"]["samples_consumed"] == 32
    assert "optimizer" in state and "state.layers.1.feed_forward.w2.weight.exp_avg" in state["optimizer"]


@pytest.mark.slow
def test_resume_reproduces_the_run_bit_for_bit(trained, tmp_path):
    out, _, final = trained
    copy_step(out, 2, tmp_path)
    trainer = train(tmp_path)
    assert sorted(losses(tmp_path)) == [3, 4]
    assert [losses(tmp_path)[s] for s in (3, 4)] == [losses(out)[s] for s in (3, 4)]
    for key, value in params(trainer).items():
        assert torch.equal(value, final[key]), key


def slow_storage(monkeypatch, seconds: float) -> None:
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    write_data = _FileSystemWriter.write_data

    def delayed(self, plan, planner):
        time.sleep(seconds)
        return write_data(self, plan, planner)

    monkeypatch.setattr(_FileSystemWriter, "write_data", delayed)


def gated_storage(monkeypatch, gates: dict[int, threading.Event], events: list[str]) -> None:
    """Storage that writes step N's checkpoint only once ``gates[N]`` is set. A save that made training
    wait for its storage would never let the gate open: after GATE_TIMEOUT_S the write goes ahead and
    ``events`` says so."""
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    write_data = _FileSystemWriter.write_data

    def gated(self, plan, planner):
        step = int(re.search(r"step-(\d+)", str(self.path)).group(1))
        opened = gates[step].wait(timeout=GATE_TIMEOUT_S)
        events.append(f"step-{step} written" if opened else f"step-{step} storage gave up waiting")
        return write_data(self, plan, planner)

    monkeypatch.setattr(_FileSystemWriter, "write_data", gated)


GATE_TIMEOUT_S = 120.0  # only reached when the behaviour under test is broken


@pytest.mark.slow
def test_async_save_writes_the_same_checkpoint_as_sync(trained, tmp_path, monkeypatch):
    out, _, _ = trained
    events: list[str] = []
    # Step 2's checkpoint may reach storage only after step 3 has trained, step 4's only after the call
    # that saves it has returned: both happen only if training goes on while storage writes.
    gates = {2: threading.Event(), 4: threading.Event()}
    gated_storage(monkeypatch, gates, events)
    trainer = make(tmp_path, "--checkpoint.async_mode", "async")
    train_step, maybe_save = trainer.train_step, trainer.checkpoint.maybe_save

    def logged_step():
        result = train_step()
        events.append(f"step {trainer.step + 1} trained")
        if trainer.step + 1 == 3:
            gates[2].set()
        return result

    def logged_save(step, tokens_seen, last=False):
        maybe_save(step, tokens_seen, last=last)
        if step in gates:
            events.append(f"save of step {step} returned")
        if step == 4:
            gates[4].set()

    trainer.train_step, trainer.checkpoint.maybe_save = logged_step, logged_save
    trainer.train()
    assert losses(tmp_path) == losses(out)
    for step in (2, 4):
        sync = flat(read_dcp(out / "checkpoint" / f"step-{step}"))
        async_ = flat(read_dcp(tmp_path / "checkpoint" / f"step-{step}"))
        assert sync.keys() == async_.keys()
        for key, value in sync.items():
            assert torch.equal(value, async_[key]) if isinstance(value, torch.Tensor) else value == async_[key], key
    timings = trainer.checkpoint.timings
    assert [t.step for t in timings] == [2, 4]
    # Training went on while storage wrote: step 3 trained before step 2's checkpoint was written (so
    # before it was durable), and the save of step 4 returned before its checkpoint was written.
    assert sorted(events) == sorted([
        "step 1 trained", "step 2 trained", "step 3 trained", "step 4 trained",
        "save of step 2 returned", "save of step 4 returned", "step-2 written", "step-4 written",
    ]), events  # (a save that blocked training would show "storage gave up waiting")
    at = {event: i for i, event in enumerate(events)}
    assert at["save of step 2 returned"] < at["step 3 trained"] < at["step-2 written"], events
    assert at["save of step 4 returned"] < at["step-4 written"], events
    assert all(t.durable_s is not None for t in timings)


@pytest.mark.slow
def test_outstanding_async_save_completes_when_training_fails(tmp_path, monkeypatch):
    slow_storage(monkeypatch, 1.0)
    trainer = make(tmp_path, "--checkpoint.async_mode", "async", "--model.n_layers", "1")
    step = trainer.train_step

    def failing_third_step():
        if trainer.step == 2:
            raise RuntimeError("boom")
        return step()

    trainer.train_step = failing_third_step
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2"]
    assert read_metadata(tmp_path / "checkpoint" / "step-2")["step"] == 2


@pytest.mark.slow
def test_incomplete_folders_are_ignored_and_cleaned_by_the_next_save(trained, tmp_path):
    out, _, _ = trained
    copy_step(out, 2, tmp_path)
    ckpt = tmp_path / "checkpoint"
    (ckpt / ".tmp-step-4").mkdir()  # a save that died: DCP files but no rename
    shutil.copy(out / "checkpoint" / "step-4" / "__0_0.distcp", ckpt / ".tmp-step-4")
    (ckpt / ".trash-step-0-1234").mkdir()  # a retention delete that died
    (ckpt / "notes.txt").write_text("not a checkpoint")
    trainer = make(tmp_path)
    assert trainer.step == 2 and trainer.loader.samples_consumed == 16
    trainer.train()
    assert sorted(p.name for p in ckpt.iterdir()) == ["notes.txt", "step-2", "step-4"]


@pytest.mark.slow
def test_load_step_picks_an_older_checkpoint(trained, tmp_path):
    out, _, _ = trained
    copy_step(out, 2, tmp_path)
    copy_step(out, 4, tmp_path)
    assert make(tmp_path).step == 4
    trainer = make(tmp_path, "--checkpoint.load_step", "2")
    assert trainer.step == 2 and trainer.lr_scheduler.last_epoch == 2
    with pytest.raises(CheckpointError, match="step-3 does not exist .*step-2, step-4"):
        make(tmp_path, "--checkpoint.load_step", "3")


@pytest.mark.slow
def test_exclude_from_loading_keeps_those_parts_fresh(trained, tmp_path):
    out, _, _ = trained
    copy_step(out, 2, tmp_path)
    trainer = make(tmp_path, "--checkpoint.exclude_from_loading", "optimizer,dataloader")
    assert trainer.step == 2 and trainer.lr_scheduler.last_epoch == 2
    assert trainer.loader.samples_consumed == 0
    assert not trainer.optimizer.state
    expected_lr = trainer.lr_scheduler.get_last_lr()[0]
    assert trainer.optimizer.param_groups[0]["lr"] == expected_lr
    with pytest.raises(ConfigError, match="unknown 'optimiser'"):
        make(tmp_path, "--checkpoint.exclude_from_loading", "optimiser")


@pytest.mark.slow
def test_weights_only_last_save_in_export_dtype(trained, tmp_path):
    out, _, _ = trained
    trainer = train(tmp_path, "--checkpoint.last_save_model_weights_only", "--checkpoint.export_dtype", "bfloat16")
    final = tmp_path / "checkpoint" / "step-4"
    meta = read_metadata(final)
    assert (meta["weights_only"], meta["dtype"], meta["contents"]) == (True, "bfloat16", ["model"])
    entries = index_keys(final)
    assert all(k.split(".", 1)[0] not in TRAINING_STATE for k in entries)
    assert {e.properties.dtype for e in entries.values()} == {torch.bfloat16}
    state = read_dcp(final)
    for key, value in params(trainer).items():
        assert torch.equal(state[key], value.to(torch.bfloat16)), key
    assert "optimizer" in read_dcp(tmp_path / "checkpoint" / "step-2"), "only the last save is weights-only"
    # Rerunning the finished run finds its final export and has nothing left to do.
    again = make(tmp_path, "--checkpoint.last_save_model_weights_only")
    assert again.step == 4
    # Training longer cannot resume from weights alone.
    with pytest.raises(CheckpointError, match="weights-only"):
        make(tmp_path, "--training.steps", "6")


@pytest.mark.slow
def test_seed_checkpoint_then_training_equals_fresh_init(trained, tmp_path):
    out, _, _ = trained
    seed = make(tmp_path, "--checkpoint.create_seed_checkpoint")
    seed.train()
    assert sorted(complete_checkpoints(tmp_path / "checkpoint")) == [0]
    meta = read_metadata(tmp_path / "checkpoint" / "step-0")
    assert meta["weights_only"] is True and meta["step"] == 0
    assert not losses(tmp_path), "a seed checkpoint does not train"
    trainer = make(tmp_path)
    assert trainer.checkpoint is not None and trainer.step == 0
    trainer.train()
    assert losses(tmp_path) == losses(out)


@pytest.mark.slow
def test_initial_load_path(trained, tmp_path):
    out, _, final = trained
    # Weights only (the default): the step-4 weights, but a fresh run at step 0.
    fresh = make(tmp_path / "a", "--checkpoint.initial_load_path", str(out / "checkpoint" / "step-4"))
    assert fresh.step == 0 and fresh.loader.samples_consumed == 0 and not fresh.optimizer.state
    for key, value in params(fresh).items():
        assert torch.equal(value, final[key]), key
    # Everything, from a checkpoint root (its newest step): continues where it stopped.
    full = make(tmp_path / "b", "--checkpoint.initial_load_path", str(out / "checkpoint"),
                "--checkpoint.initial_load_model_weights_only", "false", "--training.steps", "6")
    assert full.step == 4 and full.loader.samples_consumed == 32 and full.optimizer.state
    # The run's own checkpoint wins over initial_load_path.
    copy_step(out, 2, tmp_path / "c")
    own = make(tmp_path / "c", "--checkpoint.initial_load_path", str(out / "checkpoint" / "step-4"))
    assert own.step == 2


def test_a_tied_model_converted_to_dcp_is_an_initial_load(tmp_path):
    """A conversion stores a tied output layer once, as the embedding (Hugging Face's way); a run's DCP
    step holds both keys. Both load into a tied model as the same weights."""
    from titanctl.checkpoint.convert import convert_checkpoint

    tied = ["--model.name", "qwen3", "--model.flavor", "debugmodel", "--training.steps", "1"]
    train(tmp_path / "run", *tied, "--checkpoint.interval", "1")
    step = tmp_path / "run" / "checkpoint" / "step-1"
    convert_checkpoint(step, tmp_path / "hf", dst_format="hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "dcp", dst_format="dcp")
    from_step, from_conversion = (params(make(tmp_path / name, *tied, "--checkpoint.initial_load_path", str(source)))
                                  for name, source in (("a", step), ("b", tmp_path / "dcp")))
    for key, value in from_step.items():
        assert torch.equal(from_conversion[key], value), key


@pytest.mark.slow
def test_keep_latest_k(tmp_path):
    train(tmp_path, "--checkpoint.interval", "1", "--training.steps", "3", "--checkpoint.keep_latest_k", "2",
          "--model.n_layers", "1")
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2", "step-3"]


def test_pinned_memory_async_needs_cuda(tmp_path):
    with pytest.raises(ConfigError, match="async_with_pinned_mem.*CUDA"):
        make(tmp_path, "--checkpoint.async_mode", "async_with_pinned_mem")
    assert not (tmp_path / "checkpoint").exists()


@pytest.mark.slow
def test_muon_state_is_checkpointed_and_resumes_bit_for_bit(tmp_path):
    muon = ("--optimizer.name", "Muon", "--checkpoint.last_save_model_weights_only")
    out, resumed = tmp_path / "run", tmp_path / "resumed"
    final = params(train(out, *muon))
    step2 = read_dcp(out / "checkpoint" / "step-2")["optimizer"]
    assert "state.layers.1.feed_forward.w2.weight.momentum_buffer" in step2  # Muon's one buffer
    assert "state.layers.1.feed_forward.w2.weight.exp_avg" not in step2
    assert "state.tok_embeddings.weight.exp_avg" in step2  # embeddings stay on AdamW
    assert not {k.split(".", 1)[0] for k in index_keys(out / "checkpoint" / "step-4")} & set(TRAINING_STATE)
    # convert --to hf of a checkpoint that holds Muon's state writes the weights only
    from safetensors import safe_open

    from titanctl.checkpoint.convert import convert_checkpoint

    convert_checkpoint(out / "checkpoint" / "step-2", tmp_path / "hf", dst_format="hf")
    exported = [k for f in (tmp_path / "hf").glob("*.safetensors") for k in safe_open(f, "pt").keys()]
    assert len(exported) == len(final) and not [k for k in exported if "momentum" in k or "exp_avg" in k]
    copy_step(out, 2, resumed)
    trainer = train(resumed, *muon)
    assert [losses(resumed)[s] for s in (3, 4)] == [losses(out)[s] for s in (3, 4)]
    for key, value in params(trainer).items():
        assert torch.equal(value, final[key]), key

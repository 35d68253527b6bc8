"""`titanctl.checkpoint.locate`: the one place that tells what a checkpoint path holds, for convert,
infer-tp and checkpoint.initial_load_path alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from titanctl.checkpoint.locate import STEP_FOLDER, Located, complete_checkpoints, locate
from titanctl.checkpoint.run import load_plan, manager
from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs

TINY = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=300, max_seq_len=32)


def folder_with(path: Path, *names: str) -> Path:
    """A folder holding empty files of these names (detect reads names only, for these formats)."""
    path.mkdir(parents=True, exist_ok=True)
    for name in names:
        (path / name).write_bytes(b"")
    return path


def test_a_step_folder_is_itself(tmp_path):
    step = folder_with(tmp_path / "step-7", "titanctl.json", ".metadata")
    assert locate(step) == Located(step, "dcp", 7)
    other = folder_with(tmp_path / "export", ".metadata")  # no titanctl.json: torchtitan's DCP
    assert locate(other) == Located(other, "torchtitan", None)


def test_a_folder_of_step_folders_gives_its_newest_complete_one(tmp_path):
    root = tmp_path / "checkpoint"
    for step in (5, 12, 9):
        folder_with(root / f"step-{step}", "titanctl.json", ".metadata")
    (root / "step-20").mkdir()  # neither file: an unfinished save or a stray folder
    folder_with(root, "step-30")  # a file, not a folder
    folder_with(root / ".step-40.partial", "titanctl.json", ".metadata")  # titanctl's temporary name
    assert locate(root) == Located(root / "step-12", "dcp", 12)
    folder_with(root / "step-15", ".metadata")  # torchtitan writes .metadata last: complete
    assert locate(root) == Located(root / "step-15", "torchtitan", 15)
    # A run's own folder, read by resume, counts every step folder (a damaged one is fallen back from).
    assert sorted(complete_checkpoints(root)) == [5, 9, 12, 15, 20]


def test_foreign_folders(tmp_path):
    meta = folder_with(tmp_path / "meta", "params.json", "consolidated.00.pth")
    assert locate(meta) == Located(meta, "meta", None)
    hf = folder_with(tmp_path / "hf", "config.json", "model.safetensors")
    assert locate(hf).format == "hf"
    tune = tmp_path / "tune"
    tune.mkdir()
    torch.save({"tok_embeddings.weight": torch.zeros(2, 2), "layers.0.attn.q_proj.weight": torch.zeros(2, 2)},
               tune / "model-00001-of-00001.bin")
    assert locate(tune) == Located(tune, "torchtune", None)
    # A told format is not detected: the Source says what is missing.
    empty = folder_with(tmp_path / "empty")
    assert locate(empty, fmt="hf") == Located(empty, "hf", None)
    with pytest.raises(CheckpointError, match="unknown checkpoint format 'gguf'"):
        locate(empty, fmt="gguf")


@pytest.mark.parametrize(
    "make, what, message",
    [
        (lambda p: p / "missing", "checkpoint", r"checkpoint .*missing does not exist"),
        (lambda p: folder_with(p, "model.pt") / "model.pt", "checkpoint.initial_load_path",
         r"checkpoint.initial_load_path .*model\.pt is a file, not a checkpoint folder"),
        (lambda p: folder_with(p / "notes", "readme.txt"), "checkpoint",
         r"notes is not a checkpoint \(cannot tell the checkpoint format from its files\): expected a DCP step "
         r"folder .*a folder of step-N folders"),
        (lambda p: folder_with(p / "notes", "readme.txt"), "checkpoint.initial_load_path",
         r"checkpoint.initial_load_path .*notes is not a checkpoint"),
        (lambda p: folder_with(p / "hf", "config.json"), "checkpoint",
         r"hf has a config\.json but no \*\.safetensors files"),
        (lambda p: folder_with(p / "run" / "step-1") and folder_with(p / "run" / "step-2").parent, "checkpoint",
         r"run holds step folders \(step-1, step-2\) but none is complete: none holds titanctl\.json or \.metadata"),
    ],
    ids=["missing", "file", "no-checkpoint", "no-checkpoint-named", "config-only", "no-complete-step"],
)
def test_errors_are_one_line(tmp_path, make, what, message):
    with pytest.raises(CheckpointError, match=message) as exc:
        locate(make(tmp_path), what)
    assert "\n" not in str(exc.value)


def test_unreadable_folder(tmp_path, monkeypatch):
    folder = folder_with(tmp_path / "locked", "titanctl.json")
    real_iterdir = Path.iterdir

    def denied(self):  # as chmod 0 does for anyone but root (the tests may run as root)
        if self == folder:
            raise PermissionError(13, "Permission denied", str(self))
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", denied)
    with pytest.raises(CheckpointError, match=r"cannot read checkpoint folder .*locked: permission denied"):
        locate(folder)


def test_every_reader_of_a_path_goes_through_it(tmp_path):
    """initial_load_path, infer-tp and convert resolve a folder of step folders alike; the step
    folder pattern is defined once."""
    from titanctl.checkpoint.convert import convert_checkpoint, save_state_dict
    from titanctl.checkpoint.weights import find_checkpoint
    from titanctl.models.common.decoder import Transformer

    assert load_plan.STEP_FOLDER is manager.STEP_FOLDER is STEP_FOLDER
    state = Transformer(TINY).state_dict()
    root = tmp_path / "checkpoint"
    for step in (1, 2):
        save_state_dict(state, TINY, root / f"step-{step}", "dcp")
    assert load_plan.resolve_checkpoint_path(root, "checkpoint.initial_load_path") == root / "step-2"
    found = find_checkpoint(root)
    assert (found.folder, found.kind, found.step) == (root / "step-2", "dcp", 2)
    report = convert_checkpoint(root, tmp_path / "hf", dst_format="hf")
    assert report.src_format == "dcp" and report.notes[0].startswith("read step-2, the newest complete checkpoint")
    with pytest.raises(CheckpointError, match="checkpoint.initial_load_path .*nowhere does not exist"):
        load_plan.resolve_checkpoint_path(tmp_path / "nowhere", "checkpoint.initial_load_path")

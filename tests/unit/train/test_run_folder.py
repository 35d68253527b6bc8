"""A run's dump folder: folders it will write are checked before any work (as the user who runs it),
and metrics rows that are not ours are kept where they are, never a traceback (issue 45)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.unprivileged import as_unprivileged_user, give_away, read_only, unprivileged_home
from titanctl.config.recipe import load_config
from titanctl.errors import ConfigError
from titanctl.train import run_folder


@pytest.fixture
def home():
    with unprivileged_home() as folder:
        yield folder


def owned(path: Path) -> Path:
    """``path`` made (as folders) and given, with everything around it, to the unprivileged user."""
    path.mkdir(parents=True, exist_ok=True)
    return give_away(path)


def snapshot(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in folder.rglob("*")}


def test_resuming_into_a_read_only_checkpoint_folder_is_refused_before_anything_changes(home):
    """The regression: the first save died with a 53-line PermissionError after the steps before it."""
    from titanctl.train.trainer import Trainer

    run = owned(home / "run")
    step = owned(run / "checkpoint" / "step-2")
    (step / "titanctl.json").write_text("{}")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    owned(step)
    read_only(run / "checkpoint")
    before = snapshot(run)
    cfg = load_config(None, ["--model.n_layers", "1", "--training.steps", "6", "--checkpoint.enable_checkpoint",
                             "--job.dump_folder", str(run)])
    with as_unprivileged_user(), pytest.raises(ConfigError) as refused:
        Trainer(cfg)
    message = str(refused.value)
    assert f"checkpoint folder {run / 'checkpoint'} cannot be written" in message, message
    assert "Permission denied" in message and "\n" not in message
    assert snapshot(run) == before  # no lock left, no metrics row moved


def test_a_writable_checkpoint_folder_passes_the_same_check(home):
    run = owned(home / "run" / "checkpoint").parent
    with as_unprivileged_user():
        run_folder.prepare(run, ["checkpoint"], written={"checkpoint": "checkpoint folder"})
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint"]  # the probe file is gone


def test_a_folder_to_be_created_inside_a_read_only_one_is_refused(home):
    run = owned(home / "run" / "tb").parent
    read_only(run / "tb")
    with as_unprivileged_user(), pytest.raises(ConfigError, match=r"TensorBoard folder .*tb/inner cannot be "
                                                                   r"written \(in .*tb\): Permission denied"):
        run_folder.prepare(run, ["tb/inner"], written={"tb/inner": "TensorBoard folder"})


def test_a_read_only_dump_folder_is_refused(home):
    run = owned(home / "run")
    read_only(run)
    with as_unprivileged_user(), pytest.raises(ConfigError, match="cannot be written .Permission denied"):
        run_folder.prepare(run)


def test_a_file_where_a_written_folder_goes_is_refused(tmp_path):
    (tmp_path / "flight_recorder").write_text("not a folder")
    with pytest.raises(ConfigError, match="flight_recorder is a file; move it away"):
        run_folder.prepare(tmp_path, written={"flight_recorder": "Flight Recorder folder"})


def test_the_folders_a_run_writes_follow_its_config():
    cfg = load_config(None, ["--checkpoint.enable_checkpoint", "--metrics.enable_tensorboard",
                             "--comm.trace_buf_size", "100"])
    assert set(run_folder.folders_written(cfg, distributed=False)) == {"checkpoint", "tb"}
    assert "flight_recorder" in run_folder.folders_written(cfg, distributed=True)
    assert run_folder.folders_written(load_config(None, []), distributed=False) == {}


ROWS = [{"step": s, "loss": float(s)} for s in (1, 2, 3, 4)]


@pytest.mark.parametrize("line", [
    b'{"step": 1e999, "loss": 1.0}',  # the reported one: OverflowError
    b'{"step": NaN}', b'{"step": -Infinity}', b'{"step": 3.5}', b'{"step": "5"}', b'{"step": true}',
    b'{"step": -1}', b"[" * 100_000 + b"]" * 100_000, b'{"step": 5, "loss": "\xff\xfe"}', b"\x00\x00",
    b'"just a string"', b"{not json",
])
def test_a_metrics_line_without_a_readable_step_is_kept_with_a_note(tmp_path, line):
    rows = [json.dumps(r).encode() + b"\n" for r in ROWS]
    (tmp_path / "metrics.jsonl").write_bytes(b"".join([*rows[:2], line + b"\n", *rows[2:]]))
    note = run_folder.supersede_metrics(tmp_path, start_step=2)
    assert "2 row(s) after step 2" in note and "1 line(s) of" in note and "kept where they are" in note
    kept = (tmp_path / "metrics.jsonl").read_bytes().splitlines()
    assert line in kept and len(kept) == 3  # rows 1 and 2, and the line nobody could read
    moved = [json.loads(r) for r in (tmp_path / "metrics.superseded.jsonl").read_bytes().splitlines()]
    assert moved == ROWS[2:]


def test_a_resume_with_only_unreadable_extra_lines_moves_nothing(tmp_path):
    content = b'{"step": 1}\n{"step": 1e999}\n\n'
    (tmp_path / "metrics.jsonl").write_bytes(content)
    note = run_folder.supersede_metrics(tmp_path, start_step=1)
    assert note.startswith("1 line(s) of") and "(line 2)" in note
    assert (tmp_path / "metrics.jsonl").read_bytes() == content
    assert not (tmp_path / "metrics.superseded.jsonl").exists()

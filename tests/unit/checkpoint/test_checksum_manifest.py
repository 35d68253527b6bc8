"""Checksums cannot be bypassed by deleting them: a titanctl checkpoint records every file it has,
so a damaged shard whose record (or the whole manifest) was removed is refused, and a resuming run
falls back to the previous good step, as for a bad checksum."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.unit.checkpoint.test_checkpoint_trust import STEP, cli, clone, error_line, flip_4k, resume_falls_back


def edit_manifest(step: Path, change) -> None:
    meta_path = step / "titanctl.json"
    meta = json.loads(meta_path.read_text())
    change(meta)
    meta_path.unlink()  # a hard link of the clone's source: write a new file
    meta_path.write_text(json.dumps(meta))


def drop_record(name: str):
    return lambda meta: meta["checksums"]["files"].pop(name)


def drop_manifest(meta: dict) -> None:
    del meta["checksums"]


CASES = {
    "shard-record": (drop_record("__0_0.distcp"), r"step-2/__0_0\.distcp has no checksum in the checkpoint's titanctl\.json"),
    "index-record": (drop_record(".metadata"), r"step-2/\.metadata has no checksum in the checkpoint's titanctl\.json"),
    "manifest": (drop_manifest, r"step-2/titanctl\.json records no checksums, but titanctl writes them"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_checkpoint_without_its_record_is_refused(trained_run, tmp_path, capsys, case):
    change, message = CASES[case]
    step = clone(trained_run, tmp_path / "run") / STEP
    flip_4k(step)
    edit_manifest(step, change)
    assert re.search(message, error_line(cli(["convert", step, tmp_path / "out", "--to", "hf"], capsys)))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["shard-record", "manifest"])
@pytest.mark.slow
def test_resume_falls_back_to_the_previous_step(trained_run, tmp_path, capsys, case):
    change, message = CASES[case]
    run_dir = clone(trained_run, tmp_path / "run")
    flip_4k(run_dir / STEP)
    edit_manifest(run_dir / STEP, change)
    resume_falls_back(run_dir, message, capsys)


# ----------------------------------------------------------------------------- titanctl.json's own fields (issue 57)


def set_field(path: str, value):
    def change(meta: dict) -> None:
        *parents, last = path.split(".")
        target = meta
        for key in parents:
            target = target[key]
        target[last] = value
    return change


FIELD_EDITS = {
    "step": set_field("step", 7),
    "dim": set_field("model_args.dim", 96),
    "dtype": set_field("dtype", "bfloat16"),
    "weights_only": set_field("weights_only", True),
    "tokens_seen": set_field("tokens_seen", 1),
    "version": set_field("version", 2),  # a downgrade, to skip the check, is an edit too
}


@pytest.mark.parametrize("case", list(FIELD_EDITS))
def test_an_edited_field_of_titanctl_json_is_refused(trained_run, tmp_path, capsys, case):
    """titanctl.json recorded the checksums of every file but itself: an edited field (a LoRA rank of 10^9,
    a model dimension, a step) was read as saved. Its fields are checksummed too since version 3."""
    step = clone(trained_run, tmp_path / "run") / STEP
    edit_manifest(step, FIELD_EDITS[case])
    line = error_line(cli(["convert", step, tmp_path / "out", "--to", "hf"], capsys))
    assert re.search(r"step-2/titanctl\.json: its fields do not match the sha256 checksum recorded when the "
                     r"checkpoint was saved: the file was edited or damaged$", line), line
    assert not (tmp_path / "out").exists()


def test_titanctl_json_without_the_checksum_of_its_fields_is_refused(trained_run, tmp_path, capsys):
    step = clone(trained_run, tmp_path / "run") / STEP
    edit_manifest(step, lambda meta: meta["checksums"].pop("fields"))
    line = error_line(cli(["convert", step, tmp_path / "out", "--to", "hf"], capsys))
    assert "titanctl.json records no checksum of its own fields, but titanctl writes one from version 3 on" in line


@pytest.mark.slow
def test_resume_falls_back_from_an_edited_titanctl_json(trained_run, tmp_path, capsys):
    run_dir = clone(trained_run, tmp_path / "run")
    edit_manifest(run_dir / STEP, FIELD_EDITS["tokens_seen"])
    resume_falls_back(run_dir, r"step-2/titanctl\.json: its fields do not match", capsys)

"""Nothing outside the dump folder is written through a link a dump folder ships, and no file in it
can make a run hang: each planted link or FIFO is refused in one line (or left alone), and the
files outside stay byte for byte as they were."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import time

import pytest

from tests.cli_server import titanctl_run
from tests.conftest import OFFLINE_ENV

RUN = ["train", "--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
       "--training.mixed_precision_param", "float32", "--compile.enable", "false", "--metrics.log_freq", "1",
       "--checkpoint.enable_checkpoint", "--checkpoint.interval", "1", "--lr_scheduler.warmup_steps", "1"]
OUTSIDE = b"precious bytes that are not titanctl's\n"


def train(folder, steps: int) -> subprocess.CompletedProcess:
    env = {**os.environ, **OFFLINE_ENV}
    return titanctl_run([*RUN, "--training.steps", str(steps), "--job.dump_folder", str(folder)], env=env, timeout=300)


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A dump folder with checkpoints at steps 1 and 2 and their metrics rows."""
    folder = tmp_path_factory.mktemp("run") / "out"
    assert train(folder, 2).returncode == 0
    return folder


def planted(two_steps, tmp_path, name: str):
    """A copy of the run whose ``name`` links to an outside file; metrics.jsonl also holds rows past
    the last checkpoint, as after a crash, so that resuming rewrites it."""
    folder = tmp_path / "out"
    shutil.copytree(two_steps, folder, symlinks=True)
    rows = (folder / "metrics.jsonl").read_text()
    extra = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (3, 4))
    (folder / "metrics.jsonl").write_text(rows + extra)
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "victim"
    target.write_bytes(OUTSIDE)
    link = folder / name
    if os.path.lexists(link):
        os.unlink(link) if not link.is_dir() else shutil.rmtree(link)
    link.symlink_to(target if name != "checkpoint" else outside, target_is_directory=name == "checkpoint")
    return folder, outside


@pytest.mark.parametrize("name", [".titanctl.lock", "metrics.jsonl", "metrics.superseded.jsonl",
                                  ".metrics.jsonl.tmp", "checkpoint"])
def test_a_planted_link_never_carries_a_write_outside(two_steps, tmp_path, name):
    folder, outside = planted(two_steps, tmp_path, name)
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    proc = train(folder, 3)
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before  # nothing written, nothing pruned
    if proc.returncode:
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "symbolic link" in proc.stderr, proc.stderr
    else:  # only the temporary name: the run writes its own fresh temporary file instead
        assert name == ".metrics.jsonl.tmp"
        assert (folder / name).is_symlink()


@pytest.mark.parametrize("name", [".titanctl.lock", "metrics.jsonl"])
def test_a_fifo_in_the_dump_folder_does_not_hang(two_steps, tmp_path, name):
    folder = tmp_path / "out"
    shutil.copytree(two_steps, folder)
    (folder / name).unlink(missing_ok=True)
    os.mkfifo(folder / name)
    start = time.monotonic()
    proc = train(folder, 3)
    assert time.monotonic() - start < 60
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "not a regular file" in proc.stderr


def test_the_failure_report_for_torchrun_is_not_written_through_a_link(tmp_path, monkeypatch):
    from titanctl.parallel.runtime.elastic import record_failure

    victim = tmp_path / "victim"
    victim.write_bytes(OUTSIDE)
    report = tmp_path / "error.json"
    report.symlink_to(victim)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(report))
    record_failure("boom")  # a courtesy to torchrun: skipped rather than written through the link
    assert victim.read_bytes() == OUTSIDE and report.is_symlink()


def test_the_failure_report_for_torchrun_is_whole_or_absent(tmp_path, monkeypatch):
    """torchrun reads the report as soon as the rank is gone: a rank stopped while writing it must not
    leave an empty file (torchrun's agent crashed on one instead of restarting the job)."""
    import titanctl.parallel.runtime.elastic as elastic

    report = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(report))

    def stopped_while_writing(fd, mode):
        os.close(fd)
        raise OSError(errno.EINTR, "stopped while writing")

    with monkeypatch.context() as m:
        m.setattr(elastic.os, "fdopen", stopped_while_writing)
        elastic.record_failure("boom")
    assert not report.exists() and list(tmp_path.iterdir()) == []
    elastic.record_failure("boom")
    assert json.loads(report.read_text())["message"] == "boom" and list(tmp_path.iterdir()) == [report]

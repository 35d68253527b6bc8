"""convert when things go wrong around it: a stale partial folder whose PID now belongs to another
process, Ctrl-C, a disk or quota that fills up. Each leaves DST as it was, in one line."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

import pytest

from tests.conftest import OFFLINE_ENV, TITANCTL

STEP = ("checkpoint", "step-2")


def convert(src, dst, preexec_fn=None) -> subprocess.CompletedProcess:
    env = {**os.environ, **OFFLINE_ENV}
    return subprocess.run([*TITANCTL, "convert", str(src), str(dst), "--to", "hf"], capture_output=True, text=True,
                          env=env, timeout=300, preexec_fn=preexec_fn)


def test_a_partial_folder_whose_pid_is_alive_but_not_converting_is_removed(trained_run, tmp_path):
    dst = tmp_path / "hf"
    stale = tmp_path / f".hf.partial-{os.getpid()}"  # this test's PID: alive, and no conversion
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half written")
    proc = convert(trained_run.joinpath(*STEP), dst)
    assert proc.returncode == 0, proc.stderr
    assert (dst / "config.json").is_file() and not stale.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no lock file left either


def test_a_full_disk_or_quota_is_said_as_such(trained_run, tmp_path):
    def small_file_limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    dst = tmp_path / "hf"
    proc = convert(trained_run.joinpath(*STEP), dst, preexec_fn=small_file_limit)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1 and "the disk or quota is full" in proc.stderr, proc.stderr
    assert not dst.exists() and list(tmp_path.iterdir()) == []


def test_ctrl_c_says_it_was_interrupted_and_dst_is_untouched(trained_run, tmp_path, capsys, monkeypatch):
    from titanctl.checkpoint import convert as convert_module
    from titanctl.cli.app import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setitem(convert_module.WRITERS, "hf", interrupted)
    with pytest.raises(SystemExit) as exit_:
        main(["convert", str(trained_run.joinpath(*STEP)), str(tmp_path / "hf"), "--to", "hf"])
    err = capsys.readouterr().err
    assert exit_.value.code == 130
    assert len(err.strip().splitlines()) == 1 and "interrupted" in err and "was left as it was" in err, err
    assert "KeyboardInterrupt" not in err and list(tmp_path.iterdir()) == []
    assert sys.exc_info() == (None, None, None)

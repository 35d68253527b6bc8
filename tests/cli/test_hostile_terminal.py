"""What comes from input reaches the terminal as text: escape sequences are shown, never obeyed, and
rich markup in it is printed, not applied (it crashed with MarkupError), and so are emoji codes (a chat
split named bundled:train: was printed with a tram)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.cli_server import titanctl_run
from tests.conftest import OFFLINE_ENV

ESC = "\x1b]0;PWNED\x07"  # sets the terminal's title where obeyed
MARKUP = "[/red] [/] :train:"
HOSTILE = f"{ESC}{MARKUP}\x1b[2J"
TINY = ["--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.mixed_precision_param", "float32", "--compile.enable", "false", "--training.steps", "1"]


def titanctl(*args, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, **OFFLINE_ENV}
    return titanctl_run([*args], env=env, timeout=300, cwd=cwd)


def assert_nothing_obeyed(proc):
    text = proc.stdout + proc.stderr
    assert "\x1b" not in text and "\x07" not in text, text
    assert "MarkupError" not in text and "Traceback" not in text, text


def test_description_and_dump_folder_are_shown_as_text(tmp_path):
    proc = titanctl("train", *TINY, "--job.description", f"run {HOSTILE}",
                    "--job.dump_folder", str(tmp_path / f"out{HOSTILE}"))
    assert proc.returncode == 0, proc.stderr
    assert_nothing_obeyed(proc)
    assert "run \\x1b]0;PWNED\\x07[/red] [/] :train:\\x1b[2J" in proc.stdout  # visible, markup printed as is


def test_an_error_naming_hostile_input_is_one_visible_line(tmp_path):
    proc = titanctl("train", *TINY, "--model.tokenizer_path", f"/no/{HOSTILE}",
                    "--job.dump_folder", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert_nothing_obeyed(proc)
    assert len(proc.stderr.strip().splitlines()) == 1 and "\\x1b]0;PWNED\\x07[/red]" in proc.stderr


def test_trace_op_names_are_shown_as_text(tmp_path):
    def op(name, ts, dur):
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": {}}

    trace = {"traceEvents": [op("ProfilerStep#1", 0, 100), op(f"aten::mm{HOSTILE}", 0, 60)]}
    (tmp_path / f"rank0_trace{ESC}.json").write_text(json.dumps(trace))
    proc = titanctl("inspect-trace", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert_nothing_obeyed(proc)
    assert "aten::mm\\x1b]0;PWNED" in proc.stdout


def test_convert_shows_names_from_the_command_and_the_checkpoint_as_text(trained_run, tmp_path):
    src = tmp_path / f"step{ESC}"
    shutil.copytree(trained_run / "checkpoint" / "step-2", src)
    proc = titanctl("convert", str(src), str(tmp_path / f"hf{MARKUP}\x1b[2J"), "--to", "hf")
    assert proc.returncode == 0, proc.stderr
    assert_nothing_obeyed(proc)
    assert "\\x1b[2J" in proc.stdout


def test_a_dump_folder_that_is_not_utf8_is_one_line(tmp_path):
    folder = os.fsencode(tmp_path) + b"/out\xff"
    env = {**os.environ, **OFFLINE_ENV}
    proc = titanctl_run([b"train", *map(os.fsencode, TINY), b"--job.dump_folder", folder], env=env, timeout=120,
                        text=False)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert "is not UTF-8" in err and "\\xff" in err and not os.path.exists(folder)


@pytest.mark.parametrize("folder", ["/elsewhere/checkpoint", "../other_run/checkpoint"])
def test_a_checkpoint_folder_outside_says_how_to_start_from_another_run(tmp_path, folder):
    proc = titanctl("train", *TINY, "--checkpoint.folder", folder, "--job.dump_folder", str(tmp_path / "out"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "checkpoint.initial_load_path" in proc.stderr
    assert "initial_load_model_weights_only = false" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_flight_recorder_group_names_and_states_are_shown_as_text(tmp_path):
    def dump(rank, seqs):
        entries = [{"collective_seq_id": s, "profiling_name": "nccl:all_reduce", "process_group": ["0", HOSTILE],
                    "input_sizes": [[4]], "input_dtypes": ["Float"], "state": f"scheduled{HOSTILE}"} for s in seqs]
        return {"rank": rank, "entries": entries, "pg_config": {"0": {"name": "0", "desc": HOSTILE, "ranks": [0, 1]}}}

    (tmp_path / "rank0.json").write_text(json.dumps(dump(0, [1, 2])))
    (tmp_path / "rank1.json").write_text(json.dumps(dump(1, [1])))
    proc = titanctl("inspect-trace", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert_nothing_obeyed(proc)
    assert "scheduled\\x1b]0;PWNED" in proc.stdout


def test_the_line_a_failing_rank_prints_under_torchrun_is_shown_as_text(capsys):
    """That line is printed with plain print, not rich, so it is made visible by hand."""
    from types import SimpleNamespace

    from titanctl.train.trainer import Trainer

    rank = SimpleNamespace(env=SimpleNamespace(rank=1), step=4,
                           _where_the_run_stands=lambda: f"newest complete checkpoint: /out{HOSTILE}/step-4")
    line = Trainer._say_where_the_run_stands(rank, f"RuntimeError: {HOSTILE}")
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and len(err.splitlines()) == 1
    assert "/out\\x1b]0;PWNED\\x07[/red] [/]" in err and line.startswith("rank 1 stopped at step 5")


def test_the_flight_recorder_dump_path_is_shown_as_text(tmp_path, capsys):
    from titanctl.parallel.runtime.hang_watchdog import DumpOnce

    path = DumpOnce(tmp_path / f"out{HOSTILE}", rank=0)("step 1")
    err = capsys.readouterr().err
    assert path.is_file() and "\x1b" not in err and "\x07" not in err and len(err.splitlines()) == 1
    assert "out\\x1b]0;PWNED\\x07[/red]" in err

"""Issue 27, classes 1, 6 and 8 (in part), run as a user runs titanctl: a subprocess, offline.

- A path a checkpoint names is read only inside the checkpoint; a path given on the command line is
  read only if it is a regular file; no file's contents reach the console (a step folder naming
  ``tokenizer_path = /proc/self/environ`` printed the environment, HF token included).
- Malformed tokenizer files and a malformed torchrun environment are one line, exit 2, at once
  (``RANK >= WORLD_SIZE`` waited for peers that never come).
- A ``titanctl.json`` that is not UTF-8, or nests 10^5 deep, is one line, not a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.cli_server import titanctl_run
from tests.conftest import OFFLINE_ENV
from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH

MARKER = "SECRET_MARKER_5b1e0c"  # in the environment and in outside files: must never be printed
STEP = Path("checkpoint") / "step-2"


def titanctl(*args, cwd=None, timeout=120, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **OFFLINE_ENV, "TITANCTL_TEST_SECRET": MARKER, **env}
    return titanctl_run([*map(str, args)], env=full_env,
                          timeout=timeout, cwd=cwd)


def one_line_error(proc) -> str:
    """The single `error:` line of a refused command (exit 2, no traceback, no leaked marker)."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert MARKER not in proc.stdout + proc.stderr, "a file's contents reached the console"
    return lines[0]


def step_copy(trained_run: Path, dst: Path, **fields) -> Path:
    """A copy of the trained run's last step folder with `fields` set in its titanctl.json, whose checksum of
    its fields is re-recorded (as a careful attacker does: the check under test is the path's)."""
    from titanctl.checkpoint.trust.metadata import fields_digest

    shutil.copytree(trained_run / STEP, dst)
    meta_path = dst / "titanctl.json"
    meta = json.loads(meta_path.read_text())
    meta.update(fields)
    meta["checksums"]["fields"] = fields_digest(meta)
    meta_path.write_text(json.dumps(meta))
    return dst


def secret_file(path: Path) -> Path:
    """An outside file whose every line the old tiktoken parser would quote in its error."""
    path.write_text(f"{MARKER}\n{MARKER} {MARKER}\n")
    return path


def snapshot(root: Path) -> list:
    return sorted((str(p.relative_to(root)), p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*"))


# ----------------------------------------------------------------- class 1: paths a checkpoint names


@pytest.mark.parametrize("where", ["proc-environ", "outside-file", "link-inside-to-outside", "relative-escape"])
def test_a_tokenizer_the_checkpoint_names_outside_itself_is_not_read(trained_run, tmp_path, where):
    outside = secret_file(tmp_path / "secret.model")
    src = tmp_path / "src"
    named = {
        "proc-environ": "/proc/self/environ",
        "outside-file": str(outside),
        "link-inside-to-outside": str(src / "tokenizer.model"),
        "relative-escape": "../secret.model",
    }[where]
    step_copy(trained_run, src, tokenizer_path=named)
    (src / "tokenizer.model").symlink_to("/proc/self/environ")  # used by the link case only
    before = snapshot(tmp_path)
    line = one_line_error(titanctl("convert", src, tmp_path / "out", "--to", "hf", cwd=tmp_path))
    assert "outside" in line and "--tokenizer-path" in line, line
    assert snapshot(tmp_path) == before  # no output folder, nothing else written


def test_a_tokenizer_inside_the_checkpoint_is_used(trained_run, tmp_path):
    src = step_copy(trained_run, tmp_path / "src", tokenizer_path="tokenizer.model")  # relative: to the folder
    shutil.copy(DEFAULT_TOKENIZER_PATH, src / "tokenizer.model")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    proc = titanctl("convert", src, tmp_path / "out", "--to", "hf", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert "tokenizer: the checkpoint's tokenizer tokenizer.model" in proc.stdout
    assert (tmp_path / "out" / "tokenizer.json").is_file()


@pytest.mark.parametrize("given", ["proc-environ", "outside-file", "fifo"])
def test_a_tokenizer_path_given_on_the_command_line_never_reaches_the_console(trained_run, tmp_path, given):
    src = step_copy(trained_run, tmp_path / "src")
    path = {"proc-environ": Path("/proc/self/environ"), "outside-file": secret_file(tmp_path / "mine.model"),
            "fifo": tmp_path / "fifo.model"}[given]
    if given == "fifo":
        os.mkfifo(path)
    started = time.monotonic()
    line = one_line_error(titanctl("convert", src, tmp_path / "out", "--to", "hf", "--tokenizer-path", path,
                                   timeout=60))
    assert time.monotonic() - started < 30  # a FIFO never blocks the read
    assert str(path) in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("breakage", ["string-where-a-dict-belongs", "added-token-without-content",
                                      "merge-without-a-space", "token-outside-the-alphabet"])
def test_a_malformed_tokenizer_json_is_one_line_naming_the_file(trained_run, tmp_path, breakage):
    from titanctl.checkpoint.hf.tokenizer_export import hf_tokenizer_json
    from titanctl.data.tokenizer import Tokenizer

    spec = json.loads(hf_tokenizer_json(Tokenizer(DEFAULT_TOKENIZER_PATH)))
    if breakage == "string-where-a-dict-belongs":
        spec["pre_tokenizer"]["pretokenizers"][0] = MARKER
    elif breakage == "added-token-without-content":
        del spec["added_tokens"][3]["content"]
    elif breakage == "merge-without-a-space":
        spec["model"]["merges"][7] = MARKER
    else:
        spec["model"]["vocab"][f"{MARKER}\u2603"] = 5000
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    src = step_copy(trained_run, tmp_path / "src")
    line = one_line_error(titanctl("convert", src, tmp_path / "out", "--to", "hf", "--tokenizer-path", path))
    assert str(path) in line, line


# ------------------------------------------------------------- class 8: a garbage or deep titanctl.json


@pytest.mark.parametrize("content", [b"\xff\xfe{\x00garbage", b"[" * 100_000 + b"]" * 100_000],
                         ids=["not-utf8", "nested-1e5-deep"])
def test_a_garbage_titanctl_json_is_one_line(trained_run, tmp_path, content):
    src = tmp_path / "src"
    shutil.copytree(trained_run / STEP, src)
    (src / "titanctl.json").write_bytes(content)
    line = one_line_error(titanctl("convert", src, tmp_path / "out", "--to", "hf"))
    assert "titanctl.json" in line, line
    assert not (tmp_path / "out").exists()


def test_a_titanctl_json_linking_outside_is_not_read(trained_run, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(trained_run / STEP, src)
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"format": MARKER}))
    (src / "titanctl.json").unlink()
    (src / "titanctl.json").symlink_to(outside)
    line = one_line_error(titanctl("convert", src, tmp_path / "out", "--to", "hf"))
    assert "titanctl.json" in line and "outside" in line, line


# ------------------------------------------------------------------ class 6: the torchrun environment


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "env, variable",
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE"),
        ({"TORCHELASTIC_RESTART_COUNT": "abc"}, "TORCHELASTIC_RESTART_COUNT"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE"),
        ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, "RANK"),
        ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK"),
        ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK"),
        ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_PORT": "http"}, "MASTER_PORT"),
    ],
    ids=["world-size-abc", "restart-count-abc", "local-world-size-0", "rank-past-world", "rank-negative",
         "local-rank-past-local-world", "master-port-abc"],
)
def test_a_bad_torchrun_environment_is_one_line_at_once(tmp_path, env, variable):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **env}
    started = time.monotonic()
    line = one_line_error(titanctl("train", "--job.dump_folder", tmp_path / "dump", timeout=60, **env))
    assert time.monotonic() - started < 30  # the rank past the world waited for peers (a hang)
    assert variable in line and env[variable] in line, line
    assert not (tmp_path / "dump").exists()

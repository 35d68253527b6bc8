"""The tests' CLI server answers as `python -m titanctl` does: exit status, stdout and stderr."""

import os
import subprocess

import pytest

from tests.cli_server import titanctl_run
from tests.conftest import OFFLINE_ENV, REPO, TITANCTL

COMMANDS = [
    ["train", "--training.steps", "abc"],  # a usage error, before torch
    ["convert", "/nonexistent", "out"],  # an error after torch
    ["train", "--training.stepz", "1"],  # unknown key with a suggestion
    ["--help"],
]


@pytest.mark.parametrize("args", COMMANDS, ids=["usage", "missing-checkpoint", "unknown-key", "help"])
def test_the_server_answers_as_a_fresh_interpreter(args, tmp_path):
    env = {**os.environ, **OFFLINE_ENV, "COLUMNS": "100"}
    fresh = subprocess.run([*TITANCTL, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    served = titanctl_run(args, env=env, cwd=tmp_path, timeout=120)
    assert (served.returncode, served.stdout, served.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


def test_the_child_takes_the_commands_environment_and_folder(tmp_path):
    """A relative recipe is found in the command's folder; torchrun's variables are the command's."""
    (tmp_path / "mine.toml").write_text((REPO / "recipes" / "llama3_debug.toml").read_text())
    env = {**os.environ, **OFFLINE_ENV, "WORLD_SIZE": "abc"}
    proc = titanctl_run(["train", "--config", "mine.toml", "--job.dump_folder", "run"], env=env, cwd=tmp_path,
                        timeout=120)
    assert proc.returncode == 2 and "WORLD_SIZE" in proc.stderr and "abc" in proc.stderr, proc.stderr
    proc = titanctl_run(["train", "--config", "mine.toml", "--training.steps", "0"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "training.steps" in proc.stderr, proc.stderr  # the recipe was read


def test_a_command_past_its_timeout_is_killed(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        titanctl_run(["train", "--config", str(REPO / "recipes" / "llama3_debug.toml"), "--job.dump_folder",
                      str(tmp_path / "run")], cwd=tmp_path, timeout=2)
    # The server still answers.
    assert titanctl_run(["--help"], cwd=tmp_path, timeout=60).returncode == 0

"""The session's fork server (tests/fork_server.py) runs a worker script as its own process would:
arguments, environment, folder, streams, exit code and signals; and a script whose variables read at
start differ from the server's runs in a process of its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import torchrun_env
from tests.fork_server import VARIABLE

SCRIPT = """
import json, os, sys, time
already = "torch" in sys.modules  # a fork of the server has it imported before the script's first line
from tests.fork_server import hand_over
hand_over()
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[1:], "cwd": os.getcwd(), "rank": os.environ.get("RANK"),
                  "forked": already, "path0": sys.path[0]}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else 0)
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = os.environ[VARIABLE]  # the session's server (tests/conftest.py): it imports torch first
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        assert time.monotonic() < deadline, "the session's fork server never listened"
        time.sleep(0.1)
    folder = tmp_path_factory.mktemp("fork_server")
    (folder / "worker.py").write_text(SCRIPT)
    return folder / "worker.py"


def test_a_script_runs_forked_with_its_arguments_environment_folder_and_streams(script, tmp_path):
    proc = subprocess.run([sys.executable, "-u", str(script), "3", "a b"], env=torchrun_env(RANK="5"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    seen = json.loads(proc.stdout)
    assert proc.returncode == 3, proc.stderr
    assert seen["forked"]
    assert (seen["argv"], seen["cwd"], seen["rank"], seen["path0"]) == (["3", "a b"], str(tmp_path), "5", str(script.parent))
    assert proc.stderr == "to stderr\n"


def test_other_variables_read_at_start_run_the_script_in_its_own_process(script, tmp_path):
    proc = subprocess.run([sys.executable, "-u", str(script), "0"], env=torchrun_env(OMP_NUM_THREADS="2"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["forked"] is False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_signal_to_the_client_ends_the_child(script, tmp_path, sig):
    """torchrun stops a worker with SIGTERM to its session, then SIGKILL: the child goes either way."""
    client = subprocess.Popen([sys.executable, "-u", str(script), "sleep"], env=torchrun_env(), cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    child = json.loads(client.stdout.readline())["pid"]
    os.killpg(client.pid, sig)
    assert client.wait(timeout=30) == -sig
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}"):  # reaped by the server
        assert time.monotonic() < deadline, f"the child {child} outlived its client"
        time.sleep(0.05)


def test_the_server_outlives_a_client_and_its_child_killed_together(script, tmp_path):
    """torchrun's SIGKILL can reach a client as its child ends: the server then sees both in one wake-up
    (held here by stopping it meanwhile), and still serves the next script."""
    client = subprocess.Popen([sys.executable, "-u", str(script), "sleep"], env=torchrun_env(), cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    seen = json.loads(client.stdout.readline())
    os.kill(seen["ppid"], signal.SIGSTOP)  # the server
    try:
        os.kill(seen["pid"], signal.SIGKILL)
        while Path(f"/proc/{seen['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)  # ended (its server, stopped, cannot reap it): its end is the first event
        os.killpg(client.pid, signal.SIGKILL)
        client.wait(timeout=30)
    finally:
        os.kill(seen["ppid"], signal.SIGCONT)
    proc = subprocess.run([sys.executable, "-u", str(script), "0"], env=torchrun_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and json.loads(proc.stdout)["forked"], proc.stderr

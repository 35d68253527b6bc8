"""A dump folder is usable or refused in one line, has one owner at a time, and keeps one metrics
row per step; a configuration error under torchrun is printed once and leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli_server import titanctl_run
from tests.conftest import OFFLINE_ENV, REPO, TITANCTL, torchrun_env

TINY = ["--config", "recipes/llama3_debug.toml", "--model.n_layers", "1", "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
        "--checkpoint.enable_checkpoint", "false", "--compile.enable", "false"]  # eager: no compile time to pay


def titanctl(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return titanctl_run([*args], cwd=REPO,
                          env={**os.environ, **OFFLINE_ENV}, timeout=timeout)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_file_or_a_folder_under_a_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("mine")
    for dump, expected in [(tmp_path / "afile", "is a file"), (tmp_path / "afile" / "run", "which is a file")]:
        line = one_error_line(titanctl("train", *TINY, "--training.steps", "1", "--job.dump_folder", str(dump)))
        assert str(dump) in line and expected in line, line
    assert snapshot(tmp_path) == {"afile": b"mine"}


@pytest.mark.parametrize("dump", ["/proc/titanctl-run", "/sys/titanctl-run"], ids=["proc", "read-only-fs"])
def test_a_folder_that_cannot_be_created_is_refused(dump):
    line = one_error_line(titanctl("train", *TINY, "--training.steps", "1", "--job.dump_folder", dump))
    assert f"job.dump_folder '{dump}' cannot be created" in line, line
    assert not Path(dump).exists()


def test_a_read_only_folder_is_refused(tmp_path):
    """Read-only for this user: a folder without write permission, or, for root (whom permissions do
    not stop), a read-only file system."""
    if os.geteuid() != 0:
        dump = tmp_path / "ro"
        dump.mkdir(mode=0o555)
    else:
        dump = Path("/sys/kernel")  # sysfs is mounted read-only: not even root may write there
    line = one_error_line(titanctl("train", *TINY, "--training.steps", "1", "--job.dump_folder", str(dump)))
    assert "not writable" in line or "cannot" in line, line


def wait_until_stopped(pid: int) -> None:
    """Until the kernel reports ``pid`` stopped (state T in /proc/PID/stat)."""
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.01)
    time.sleep(0.2)  # and a moment more for a write that the kernel was completing


def test_one_run_per_dump_folder_and_a_dead_owner_is_taken_over(tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen([*TITANCTL, "train", *TINY, "--training.steps", "100000", "--job.dump_folder", str(out)],
                             cwd=REPO, env={**os.environ, **OFFLINE_ENV}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start training"
            time.sleep(0.1)
        first.send_signal(signal.SIGSTOP)  # holds the lock, changes nothing while we look
        wait_until_stopped(first.pid)  # the signal is delivered asynchronously: a write may still be under way
        before = snapshot(out)
        line = one_error_line(titanctl("train", *TINY, "--training.steps", "1", "--job.dump_folder", str(out)))
        assert f"is in use by another run (host {os.uname().nodename}, PID {first.pid}" in line, line
        assert snapshot(out) == before, "the refused run changed the folder"
    finally:
        first.kill()
        first.wait()
    taken = titanctl("train", *TINY, "--training.steps", "1", "--job.dump_folder", str(out))
    assert taken.returncode == 0, taken.stderr
    assert f"took over the dump folder lock of host {os.uname().nodename}, PID {first.pid}" in taken.stdout
    assert not (out / ".titanctl.lock").exists(), "a clean end leaves no lock behind"


def test_a_new_run_keeps_the_metrics_of_the_previous_one_apart(tmp_path):
    out = tmp_path / "run"
    assert titanctl("train", *TINY, "--training.steps", "2", "--job.dump_folder", str(out)).returncode == 0
    earlier = (out / "metrics.jsonl").read_text()
    again = titanctl("train", *TINY, "--training.steps", "3", "--training.seed", "7", "--job.dump_folder", str(out))
    assert again.returncode == 0, again.stderr
    (kept,) = out.glob("metrics.2*.jsonl")
    assert kept.read_text() == earlier
    assert f"held an earlier run's rows: moved to {kept.name}; this run starts a new metrics.jsonl" in again.stdout
    assert [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def torchrun_titanctl(target: list[str], args: list[str], *torchrun_args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *torchrun_args,
         *target, *args],
        capture_output=True, text=True, cwd=REPO, env=torchrun_env(), timeout=300,
    )


def exit_codes(proc: subprocess.CompletedProcess) -> list[str]:
    """Each failed rank's exit code in torchrun's summary."""
    return [line.split(":")[1].split("(")[0].strip() for line in proc.stderr.splitlines()
            if line.strip().startswith("exitcode")]


def test_a_config_error_under_torchrun_is_printed_once_and_leaves_nothing(tmp_path):
    """Every rank refuses the layout before it joins the process group, so none is left half-connected to a
    peer that already left (which ended in a gloo traceback, "connectFullMesh failed", on a slower machine)."""
    out = tmp_path / "run"
    proc = torchrun_titanctl(["-m", "titanctl", "train"],
                             [*TINY, "--parallelism.tensor_parallel_degree", "3", "--job.dump_folder", str(out)])
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "tp 3" in errors[0], proc.stderr[-3000:]
    assert "Gloo" not in proc.stderr and f"{REPO}/titanctl/" not in proc.stderr, proc.stderr[-3000:]  # no traceback
    assert "exitcode  : 2 " in proc.stderr.split("Root Cause")[-1], proc.stderr[-3000:]
    # Rank 0 says it and exits 2; the other exits 2 as well, or torchrun stops it first (SIGTERM): a rank
    # that has not reached its own check yet when rank 0 ends is stopped, which is no crash.
    assert len(exit_codes(proc)) == 2 and set(exit_codes(proc)) <= {"2", "-15"}, proc.stderr[-3000:]
    assert "To enable traceback" not in proc.stderr, "torchrun's summary should carry the error itself"
    assert not out.exists()


def test_a_rank_whose_peer_failed_during_set_up_names_the_peers_failure(tmp_path):
    """Rank 0 fails alone after the group formed (workers/peer_failure_worker.py plants it); rank 1, waiting
    for it in a collective, stops in one line that names rank 0's failure. The two ranks run as torchrun
    starts them, with this test as the agent that hosts their store, and no agent that would stop rank 1
    with SIGTERM once rank 0 has exited: what rank 1 does then is always seen."""
    import torch.distributed as dist

    from tests.distributed.harness import WORKERS
    from tests.distributed.workers.peer_failure_worker import PLANTED

    store = dist.TCPStore("127.0.0.1", 0, world_size=3, is_master=True, wait_for_workers=False)
    agent = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
             "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0", "GROUP_RANK": "0"}
    ranks = [subprocess.Popen(
        [sys.executable, str(WORKERS / "peer_failure_worker.py"), *TINY, "--training.steps", "1",
         "--job.dump_folder", str(tmp_path / "run")],
        cwd=REPO, env=torchrun_env(**agent, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for r in range(2)]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    errors = [[line for line in err.splitlines() if line.strip()] for _, err in outputs]
    assert errors == [[f"error: [rank 0] {PLANTED}"],
                      [f"error: [rank 1] stopped while the job was setting up: rank 0 failed: {PLANTED}"]], errors
    assert [rank.returncode for rank in ranks] == [2, 2]

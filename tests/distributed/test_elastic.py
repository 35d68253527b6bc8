"""Fault tolerance and multi-node on real torchrun + gloo.

- Restarts: one run under ``--max-restarts 4`` loses a rank four ways (SIGKILL between saves,
  SIGKILL in the middle of a save, an exception, a hang that the watchdog catches) and still ends
  with the losses and the samples of the uninterrupted run, bit for bit, one metrics row per step.
- Exhausted restarts: the last lines name the rank that died, how, and the newest complete checkpoint.
- Two nodes on localhost (two torchrun invocations, c10d rendezvous) = one process.
- ``slurm/multinode_trainer.slurm`` with ``srun``/``scontrol`` faked on PATH: two "nodes", the
  process count from Slurm's variables, ``--max-restarts`` passed on.
- Shrink: of two nodes (4 ranks), one is lost for good; the other goes on with 2 ranks, the same
  global batch and the same samples.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import fork_server
from tests.conftest import REPO, torchrun_env
from tests.distributed.harness import (
    CLI,
    WORKERS,
    kill_job,
    losses_by_step,
    rows,
    sample_log,
    samples_by_step,
    torchrun,
    wait_until,
)

WORKER = [str(WORKERS / "ckpt_worker.py")]
STEPS = 12
RUN = [
    "--model.n_layers", "2",
    "--training.seq_len", "32",
    "--training.global_batch_size", "8",
    "--training.local_batch_size", "4",
    "--training.steps", str(STEPS),
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--activation_checkpoint.mode", "none",
    "--checkpoint.enable_checkpoint",
    "--checkpoint.interval", "3",
    "--checkpoint.keep_latest_k", "0",
]


def env() -> dict[str, str]:
    return torchrun_env()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], log: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=REPO, env={**env(), **(extra_env or {})}, stdout=open(log, "w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def torchrun_cmd(*options: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *options]


def workers(out: Path) -> dict[tuple[int, int], int]:
    """(torchrun attempt, rank) -> PID of the live workers training into ``out``."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = dict(
                item.split(b"=", 1) for item in (proc / "environ").read_bytes().split(b"\0") if b"=" in item
            )
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError):
            continue
        if state == "Z" or str(out).encode() not in cmdline or b"RANK" not in environ:
            continue
        found[(int(environ.get(b"TORCHELASTIC_RESTART_COUNT", b"0")), int(environ[b"RANK"]))] = int(proc.name)
    return found


def attempt_reached(out: Path, attempt: int, step: int) -> bool:
    """Attempt ``attempt`` runs and has logged ``step`` (rows of earlier attempts after the step it
    resumed from were superseded when it started)."""
    logged = rows(out)
    starts = [i for i, r in enumerate(logged) if r.get("restart") == attempt] if attempt else [0]
    return bool(starts) and any(r["step"] >= step for r in logged[starts[-1]:])


def dump_reason(path: Path) -> str:
    try:
        return json.loads(path.read_text())["titanctl"]["reason"]
    except (OSError, ValueError, KeyError):
        return ""


def signal_worker(out: Path, attempt: int, rank: int, sig: int) -> None:
    os.kill(workers(out)[(attempt, rank)], sig)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("elastic_reference")
    torchrun(2, WORKER, [*RUN, "--job.dump_folder", str(out)])
    return out


def test_any_lost_rank_restarts_and_resumes_bit_for_bit(reference, tmp_path):
    """Four failures in one run, each followed by a torchrun restart that resumes by itself."""
    rng = random.Random(20261124)
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    job = start(torchrun_cmd("--standalone", "--nproc_per_node=2", "--max-restarts=4", *WORKER,
                             "--test-write-delay", "0.6", "--test-fail-at", "2:1:8",
                             *RUN, "--comm.train_timeout_seconds", "4", "--job.dump_folder", str(out)), log,
                fork_server.OWN_PROCESSES)  # it stops a rank with SIGSTOP
    try:
        # Attempt 0: rank 1 is SIGKILLed between saves, at a random step.
        kill_at = rng.choice([4, 5])
        wait_until(lambda: attempt_reached(out, 0, kill_at), job, log)
        signal_worker(out, 0, 1, signal.SIGKILL)
        # Attempt 1: rank 0 is SIGKILLed while step-6 is being written: step-3 stays the newest.
        wait_until(lambda: (1, 0) in workers(out) and (out / "checkpoint" / ".tmp-step-6").is_dir(), job, log)
        time.sleep(rng.uniform(0.0, 0.4))  # inside the 0.6 s write window
        signal_worker(out, 1, 0, signal.SIGKILL)
        # Attempt 2: rank 1 raises at step 8 (--test-fail-at). Attempt 3: rank 1 stops answering
        # after its first step; rank 0's watchdog catches the hang, dumps the Flight Recorder, exits.
        wait_until(lambda: attempt_reached(out, 3, 8), job, log)
        signal_worker(out, 3, 1, signal.SIGSTOP)
        hung = out / "flight_recorder" / "rank0.json"  # every failure before dumped it too, for other reasons
        wait_until(lambda: "exceeded watchdog" in dump_reason(hung), job, log)
        for pid in [pid for (attempt, _), pid in workers(out).items() if attempt == 3]:
            os.kill(pid, signal.SIGCONT)  # so that torchrun's SIGTERM reaches it
        assert job.wait(timeout=400) == 0, log.read_text()[-5000:]
    finally:
        if job.poll() is None:
            kill_job(job)
    text = log.read_text()
    for restart in (1, 2, 3, 4):
        assert f"after restart {restart}" in text, f"restart {restart} did not resume:\n{text[-4000:]}"
    assert "resumed from step-3 after restart 2" in text, "the save killed midway must not be loaded"
    assert "injected failure at step 8" in text
    # One row per step, and each equals the uninterrupted run's loss bit for bit.
    logged = rows(out)
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1)), [r["step"] for r in logged]
    ref = losses_by_step(reference)
    assert {r["step"]: r["loss"] for r in logged} == ref
    # Each surviving first row of an attempt says where it resumed: attempt 2 from step 3 (its rows
    # 4-6 stand), attempt 4 from step 6; the other attempts' rows were all superseded.
    starts = {r["step"]: (r["resumed_from_step"], r["restart"]) for r in logged if "restart" in r}
    assert starts == {4: (3, 2), 7: (6, 4)}, starts
    # The same sequences in every step whichever attempt trained it: nothing repeated or skipped.
    assert samples_by_step(out) == samples_by_step(reference)
    assert all(e["consumed_before"] == (e["step"] - 1) * 8 for e in sample_log(out))
    superseded = [json.loads(line) for line in (out / "metrics.superseded.jsonl").read_text().splitlines()]
    assert superseded and all(r["loss"] == ref[r["step"]] for r in superseded)


def test_exhausted_restarts_name_the_rank_the_cause_and_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    job = start(torchrun_cmd("--standalone", "--nproc_per_node=2", "--max-restarts=1", *WORKER, *RUN,
                             "--job.dump_folder", str(out)), log)
    try:
        for attempt in (0, 1):
            wait_until(lambda a=attempt: attempt_reached(out, a, 4 + 3 * a), job, log)
            signal_worker(out, attempt, 1, signal.SIGKILL)
        assert job.wait(timeout=120) != 0
    finally:
        if job.poll() is None:
            kill_job(job)
    tail = log.read_text().splitlines()[-50:]
    text = "\n".join(tail)
    newest = max(int(p.name[5:]) for p in (out / "checkpoint").glob("step-*"))
    assert f"newest complete checkpoint: {out}/checkpoint/step-{newest}" in text, text
    assert "restarts exhausted (1 of 1 used)" in text, text
    root_cause = text[text.index("Root Cause"):]
    assert "rank      : 1" in root_cause and "SIGKILL" in root_cause, root_cause


def two_node_cmd(node_rank: int, port: int, *args: str) -> list[str]:
    return torchrun_cmd("--nnodes=2", f"--node_rank={node_rank}", "--nproc_per_node=2", "--rdzv_backend=c10d",
                        f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two-nodes", "-m", "titanctl", "train",
                        "--config", "recipes/llama3_debug.toml", *args)


# RUN without checkpoints, 4 steps; eager (the debug recipe compiles: these tests are about launching,
# and test_layouts.py checks compiled layouts), which saves each process its compile.
SHORT = [*RUN[:8], "--training.steps", "4", *RUN[10:16], "--compile.enable", "false"]


@pytest.fixture(scope="module")
def short_single(tmp_path_factory) -> Path:
    """SHORT in one process: what the two-node and Slurm runs must equal."""
    single = tmp_path_factory.mktemp("short_single")
    torchrun(1, [*CLI, "train", "--config", "recipes/llama3_debug.toml"],
             [*SHORT, "--training.local_batch_size", "8", "--job.dump_folder", str(single)])
    return single


def test_two_nodes_on_localhost_equal_one_process(short_single, tmp_path):
    """FSDP 2 x TP 2 over two torchrun invocations (2 ranks each) matches one process."""
    single = short_single
    out, port = tmp_path / "two_nodes", free_port()
    args = [*SHORT, "--parallelism.tensor_parallel_degree", "2", "--job.dump_folder", str(out)]
    nodes = [start(two_node_cmd(r, port, *args), tmp_path / f"node{r}.log") for r in (0, 1)]
    try:
        codes = [node.wait(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_job(node)
    assert codes == [0, 0], "\n".join((tmp_path / f"node{r}.log").read_text()[-3000:] for r in (0, 1))
    assert "dp_shard 2 x tp 2" in (tmp_path / "node0.log").read_text() + (tmp_path / "node1.log").read_text()
    ref, got = losses_by_step(single), losses_by_step(out)
    assert sorted(got) == [1, 2, 3, 4]
    for step, loss in ref.items():
        assert abs(got[step] - loss) <= 1e-5 * abs(loss), (step, got[step], loss)


FAKE_SLURM = Path(__file__).parent / "fake_slurm"


def test_slurm_script_runs_two_nodes_with_fake_srun(short_single, tmp_path):
    """The sbatch script itself, on two fake nodes: GPUs per node from Slurm's variables, restarts
    on, c10d rendezvous on the head node, and the result equals one process."""
    single = short_single
    out, slurm_log = tmp_path / "slurm_run", tmp_path / "slurm.log"
    slurm_env = {
        "PATH": f"{FAKE_SLURM}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2",
        "SLURM_GPUS_ON_NODE": "2", "RDZV_PORT": str(free_port()), "FAKE_SLURM_LOG": str(slurm_log),
    }
    proc = subprocess.run(
        ["bash", "slurm/multinode_trainer.slurm", "recipes/llama3_debug.toml", *SHORT,
         "--training.local_batch_size", "2", "--job.dump_folder", str(out)],
        cwd=REPO, env={**env(), **slurm_env}, capture_output=True, text=True, timeout=300,
    )
    node_logs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("slurm.log.node*")))
    assert proc.returncode == 0, proc.stderr[-3000:] + node_logs[-6000:]
    calls = slurm_log.read_text().splitlines()
    assert calls[0] == "srun --nodes=1 --ntasks=1 -w node1 hostname --ip-address"
    launch = calls[1]
    for expected in ("--nnodes 2:2", "--nproc_per_node 2", "--max-restarts 3", "--rdzv_backend c10d",
                     f"--rdzv_endpoint 127.0.0.1:{slurm_env['RDZV_PORT']}", "--rdzv_id 4242", "--kill-on-bad-exit=1"):
        assert expected in launch, (expected, launch)
    assert "dp_shard 4" in node_logs
    ref, got = losses_by_step(single), losses_by_step(out)
    assert sorted(got) == [1, 2, 3, 4]
    for step, loss in ref.items():
        assert abs(got[step] - loss) <= 1e-5 * abs(loss), (step, got[step], loss)


def elastic_node_cmd(port: int, *args: str) -> list[str]:
    return torchrun_cmd("--nnodes=1:2", "--nproc_per_node=2", "--max-restarts=1", "--rdzv_backend=c10d",
                        f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=shrink", "--rdzv-conf=last_call_timeout=8",
                        *WORKER, *args)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_lost_node_shrinks_the_job_and_a_new_node_grows_it_again(reference, tmp_path):
    """Two nodes of 2 ranks (FSDP 4). Node B is lost for good after step 4: node A restarts alone
    (FSDP 2), resumes from step-3 with the same global batch of 8 (now 2 microbatches per step). A new
    node C then joins: torchrun restarts A's workers (a membership change, not a counted restart)
    and the job goes on with 4 ranks again. It ends with the uninterrupted run's samples, and its
    losses within the tolerance of a layout change."""
    out, port = tmp_path / "run", free_port()
    args = ["--test-step-delay", "0.3", *RUN, "--training.local_batch_size", "2", "--training.global_batch_size", "-1",
            "--job.dump_folder", str(out)]
    fresh_store = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # what scale-up needs (see docs/fault-tolerance.md)
    node_a = start(elastic_node_cmd(port, *args), tmp_path / "a.log", fresh_store)
    others = []
    try:
        wait_until(lambda: listening(port), node_a, tmp_path / "a.log")  # A hosts the rendezvous
        others.append(start(elastic_node_cmd(port, *args), tmp_path / "b.log", fresh_store))
        wait_until(lambda: attempt_reached(out, 0, 4), node_a, tmp_path / "a.log")
        assert len(workers(out)) == 4
        kill_job(others[0])  # node B and its agent, for good
        wait_until(lambda: attempt_reached(out, 1, 5), node_a, tmp_path / "a.log")
        assert len(workers(out)) == 2
        others.append(start(elastic_node_cmd(port, *args), tmp_path / "c.log", fresh_store))
        assert node_a.wait(timeout=300) == 0, (tmp_path / "a.log").read_text()[-5000:]
        assert others[1].wait(timeout=60) == 0, (tmp_path / "c.log").read_text()[-5000:]
    finally:
        for node in (node_a, *others):
            if node.poll() is None:
                kill_job(node)
    text = (tmp_path / "a.log").read_text()
    layouts = [line.split("layout ")[1].split(",")[0] for line in text.splitlines() if "params, vocab" in line]
    assert layouts == ["dp_shard 4", "dp_shard 2", "dp_shard 4"], layouts
    assert "resumed from step-3 after restart 1" in text
    assert "global batch 8 x 32 tokens, 2 microbatch(es)/step" in text
    logged = rows(out)
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    assert samples_by_step(out) == samples_by_step(reference)
    ref = losses_by_step(reference)
    for r in logged:
        assert abs(r["loss"] - ref[r["step"]]) <= 1e-5 * abs(ref[r["step"]]), (r["step"], r["loss"], ref[r["step"]])

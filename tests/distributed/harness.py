"""Launch titanctl under torchrun on gloo and read back what it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from scripts.ft_local import kill
from tests.conftest import REPO, torchrun_env

WORKERS = Path(__file__).parent / "workers"
# `titanctl ARGS` on every rank, as a fork of the session's server (workers/cli_worker.py): [*CLI, "train", ...].
CLI = [str(WORKERS / "cli_worker.py")]

# A few tiny layers, fp32, fixed global batch: every layout must reproduce these losses.
# Every step clips (max_norm 0.02, the norms are ~0.85), and AdamW's eps is raised so that it sees the
# clipping: with 1e-8, AdamW is blind to a gradient's scale and an unclipped run's loss 2 is only 5e-6
# (relative) away; with 1e-6 it is 1.2e-3 away, a hundred times the tolerance. So a layout that skips the
# clipping, or clips by a norm that misses some ranks' gradients, fails.
TINY_RUN = [
    "--training.max_norm", "0.02",
    "--optimizer.eps", "1e-6",
    "--model.n_layers", "4",
    "--training.seq_len", "64",
    "--training.global_batch_size", "8",
    "--training.steps", "3",  # loss 3 is the first that the optimizer state of an earlier step shapes
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--activation_checkpoint.mode", "none",
]


def torchrun(
    nproc: int, target: list[str], args: list[str], timeout: int = 400, check: bool = True
) -> subprocess.CompletedProcess:
    """``target`` is a script path, [*CLI, command], or ['-m', 'titanctl', command]; ``check`` raises on a
    non-zero exit."""
    env = torchrun_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *target, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def lone_rank(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    """``titanctl ARGS`` as rank 0 of a torchrun job of ``nproc`` whose other ranks never come: a refusal
    that the Trainer makes before it joins the process group ends at once, anything later would wait for
    the missing ranks until comm.init_timeout_seconds."""
    import socket

    from tests.cli_server import titanctl_run

    with socket.socket() as s:  # a port nobody listens on: rank 0 would host the job's store there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = torchrun_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return titanctl_run([*args, "--comm.init_timeout_seconds", "60"], env=env, cwd=REPO, timeout=120)


def losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def worst_tensor_diff(got: dict, ref: dict) -> tuple[float, str]:
    """(the largest |got - ref| over the reference tensor's largest |value|, the tensor's name), over
    tensors of the same names."""
    assert got.keys() == ref.keys(), sorted(got.keys() ^ ref.keys())
    diffs = {name: ((got[name] - t).abs().max() / t.abs().max()).item() for name, t in ref.items()}
    worst = max(diffs, key=diffs.get)
    return diffs[worst], worst


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------- what a run wrote


def rows(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses_by_step(folder: Path) -> dict[int, float]:
    """The last logged loss of each step (a resumed run logs the re-run steps again)."""
    return {r["step"]: r["loss"] for r in rows(folder)}


def gathered(folder: Path, nproc: int, what: str) -> dict:
    """{canonical name: full tensor} over the ranks' {what}_rank{r}.pt (``init``: the initial weights,
    ``grads``: the first step's gradients), which ranks that hold a tensor must agree on (pipeline
    stages hold different names)."""
    import torch

    merged = {}
    for rank in range(nproc):
        for name, tensor in torch.load(folder / f"{what}_rank{rank}.pt").items():
            assert name not in merged or torch.equal(merged[name], tensor), f"ranks disagree on {what} {name}"
            merged[name] = tensor
    return merged


def init_digests(folder: Path, nproc: int) -> dict[str, str]:
    """{canonical name: digest of the initial tensor} over the ranks of a world case (workers/world_worker.py),
    which ranks that hold a tensor must agree on."""
    merged: dict[str, str] = {}
    for rank in range(nproc):
        for name, digest in json.loads((folder / f"init_digests_rank{rank}.json").read_text()).items():
            assert merged.setdefault(name, digest) == digest, f"ranks disagree on the initial {name}"
    return merged


def assert_same_init(folder: Path, nproc: int, reference: dict[str, str]) -> None:
    """The case's initial weights equal the reference's bit for bit (digests of ``init_digests``)."""
    got = init_digests(folder, nproc)
    assert got.keys() == reference.keys(), sorted(got.keys() ^ reference.keys())
    differ = sorted(name for name, digest in reference.items() if got[name] != digest)
    assert not differ, f"initial {', '.join(differ)} differ(s) from one process"


def expert_loads(folder: Path) -> list:
    return [row.get("expert_load") for row in rows(folder)]


def sample_log(folder: Path) -> list[dict]:
    entries = []
    for path in sorted(folder.glob("samples_rank*.jsonl")):
        entries += [json.loads(line) for line in path.read_text().splitlines()]
    return entries


def samples_by_step(folder: Path) -> dict[int, set[str]]:
    """Step -> the hashes of every sequence any rank trained on in that step."""
    out: dict[int, set[str]] = {}
    for entry in sample_log(folder):
        out.setdefault(entry["step"], set()).update(entry["rows"])
    return out


# ----------------------------------------------------------------------------- killing runs


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every process under it at once (its workers run in their own sessions)."""
    kill(proc)
    time.sleep(0.2)  # let the kernel reap the workers before the next launch reads the folder


def wait_until(condition, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            tail = log.read_text()[-4000:]
            raise AssertionError(f"the run ended (exit {proc.returncode}) before the kill point:\n{tail}")
        if time.monotonic() > deadline:
            kill_job(proc)
            raise AssertionError(f"timed out waiting for the kill point:\n{log.read_text()[-4000:]}")
        time.sleep(0.002)

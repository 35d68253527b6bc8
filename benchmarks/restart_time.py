"""Restarts under torchrun, measured: kill a rank again and again, time each comeback, and check
that the run still ends with the uninterrupted run's losses, bit for bit.

Runs the debug recipe under ``torchrun --standalone --nproc_per_node 2 --max-restarts K`` (FSDP 2)
with a checkpoint every few steps, SIGKILLs a random rank at a random step of every attempt but the
last, and prints, per restart, the seconds from the kill to the first step the restarted job
completed (torchrun noticing, new processes, imports, process group, checkpoint load, that step),
then whether every restart resumed and the losses equal an uninterrupted run's.

    PYTHONPATH=. .venv/bin/python benchmarks/restart_time.py [--kills 10] [--runs 2] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def titanctl_run(out: Path, steps: int, max_restarts: int, seq_len: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        f"--max-restarts={max_restarts}", "-m", "titanctl", "train", "--config", "recipes/llama3_debug.toml",
        "--training.steps", str(steps), "--training.seq_len", str(seq_len), "--training.local_batch_size", "4",
        "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1",
        "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "2", "--job.dump_folder", str(out),
    ]


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO)}


def rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    try:
        return [json.loads(line) for line in path.read_text().splitlines()]
    except (OSError, ValueError):  # mid-rewrite
        return []


def worker_pids(out: Path, attempt: int) -> dict[int, int]:
    """rank -> PID of the workers of torchrun attempt ``attempt`` training into ``out``."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if str(out).encode() not in (proc / "cmdline").read_bytes():
                continue
            environ = dict(i.split(b"=", 1) for i in (proc / "environ").read_bytes().split(b"\0") if b"=" in i)
        except (OSError, ValueError):
            continue
        if b"RANK" in environ and int(environ.get(b"TORCHELASTIC_RESTART_COUNT", b"0")) == attempt:
            found[int(environ[b"RANK"])] = int(proc.name)
    return found


def first_row_of(out: Path, attempt: int) -> dict | None:
    return next((r for r in rows(out) if r.get("restart") == attempt), None)


def one_run(kills: int, steps: int, seq_len: int, rng: random.Random, folder: Path) -> tuple[list[float], bool]:
    out = folder / "killed"
    job = subprocess.Popen(titanctl_run(out, steps, kills, seq_len), cwd=REPO, env=env(),
                           stdout=open(folder / "killed.log", "w"), stderr=subprocess.STDOUT)
    comebacks = []
    try:
        for attempt in range(kills):
            # Kill somewhere 1-3 steps after the attempt's first completed step.
            start = 0 if attempt == 0 else first_row_of_wait(out, attempt, job)["step"]
            target = start + rng.randint(1, 3)
            while not any(r["step"] >= target for r in rows(out)[-4:]) or len(worker_pids(out, attempt)) < 2:
                if job.poll() is not None:
                    raise SystemExit(f"the run ended early (exit {job.returncode}); see {folder / 'killed.log'}")
                time.sleep(0.01)
            os.kill(worker_pids(out, attempt)[rng.randrange(2)], signal.SIGKILL)
            killed_at = time.perf_counter()
            first_row_of_wait(out, attempt + 1, job)
            comebacks.append(time.perf_counter() - killed_at)
            print(f"  restart {attempt + 1}: first resumed step done {comebacks[-1]:.1f} s after the kill", flush=True)
        code = job.wait()
    finally:
        if job.poll() is None:
            job.kill()
    reference = folder / "reference"
    subprocess.run(titanctl_run(reference, steps, 0, seq_len), cwd=REPO, env=env(), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    equal = code == 0 and {r["step"]: r["loss"] for r in rows(out)} == {r["step"]: r["loss"] for r in rows(reference)}
    return comebacks, equal


def first_row_of_wait(out: Path, attempt: int, job: subprocess.Popen) -> dict:
    while (row := first_row_of(out, attempt)) is None:
        if job.poll() is not None:
            raise SystemExit(f"the run ended (exit {job.returncode}) before restart {attempt} logged a step")
        time.sleep(0.01)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10, help="SIGKILLs (and restarts) per run")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    rng = random.Random(opts.seed)
    times, all_equal = [], True
    for run in range(opts.runs):
        with tempfile.TemporaryDirectory(prefix="titanctl-restarts-") as tmp:
            print(f"run {run + 1}: {opts.kills} kills", flush=True)
            comebacks, equal = one_run(opts.kills, steps=4 * opts.kills + 6, seq_len=opts.seq_len, rng=rng,
                                       folder=Path(tmp))
            print(f"  losses equal to the uninterrupted run, bit for bit: {'yes' if equal else 'NO'}")
            times += comebacks
            all_equal &= equal
    print(f"{len(times)} restarts, all resumed; kill -> first resumed step: median {statistics.median(times):.1f} s, "
          f"min {min(times):.1f} s, max {max(times):.1f} s; every run equal to its reference: "
          f"{'yes' if all_equal else 'NO'}")


if __name__ == "__main__":
    main()

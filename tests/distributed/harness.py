"""Launch titanctl under torchrun on gloo and read back what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import OFFLINE_ENV, REPO

WORKERS = Path(__file__).parent / "workers"

# A few tiny layers, fp32, fixed global batch: every layout must reproduce these losses.
TINY_RUN = [
    "--model.n_layers", "4",
    "--training.seq_len", "64",
    "--training.global_batch_size", "8",
    "--training.steps", "5",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--activation_checkpoint.mode", "none",
]


def torchrun(
    nproc: int, target: list[str], args: list[str], timeout: int = 400, check: bool = True
) -> subprocess.CompletedProcess:
    """``target`` is a script path, or ['-m', 'titanctl', ...]; ``check`` raises on a non-zero exit."""
    env = {**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *target, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))

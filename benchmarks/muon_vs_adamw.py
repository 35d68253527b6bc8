"""AdamW against Muon on the Qwen3 debug model (recipes/qwen3_debug.toml) and the bundled corpus.

Each optimizer trains the recipe's run (300 steps, its batch, LR schedule and seed) as ``titanctl train`` does,
once in one process and once under ``torchrun`` with 2 processes (FSDP 2, the recipe's batch per rank). Validation on
the bundled validation set runs every ``--val-freq`` steps, so both optimizers are compared at the same tokens.
Printed: each run's validation loss at every validation step, and the median step time (the first steps, which
include set-up, left out) with Muon's overhead over AdamW at 1 and 2 processes. Muon uses the recipe's lr (its
0.2 sqrt(max(m, n)) scale matches AdamW's update RMS, so one lr serves both).

    PYTHONPATH=. .venv/bin/python benchmarks/muon_vs_adamw.py [--steps 300] [--val-freq 50] [--val-steps 10]
        [--procs 1,2] [--skip 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "qwen3_debug.toml"


def train(optimizer: str, procs: int, steps: int, val_freq: int, val_steps: int, folder: Path) -> list[dict]:
    """The run's metrics.jsonl rows."""
    launcher = [sys.executable, "-m", "titanctl"] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs), "-m", "titanctl"]
    args = ["train", "--config", str(RECIPE), "--optimizer.name", optimizer, "--training.steps", str(steps),
            "--job.dump_folder", str(folder), "--metrics.log_freq", "1", "--checkpoint.enable_checkpoint", "false",
            "--validation.enabled", "--validation.freq", str(val_freq), "--validation.dataset", "bundled_val",
            "--validation.steps", str(val_steps)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // procs))}
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "console.txt", "w") as log:  # the run's console, read back if it fails
        code = subprocess.run([*launcher, *args], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        sys.exit(f"{optimizer} at {procs} process(es) failed (exit {code}):\n"
                 + (folder / "console.txt").read_text()[-3000:])
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def step_seconds(rows: list[dict], skip: int) -> float:
    times = [r["step_time"] for r in rows if "step_time" in r and r["step"] > skip]
    return statistics.median(times) if times else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--val-freq", type=int, default=50)
    parser.add_argument("--val-steps", type=int, default=10, help="validation batches (-1: the whole set)")
    parser.add_argument("--procs", default="1,2")
    parser.add_argument("--skip", type=int, default=3, help="first steps left out of the step time")
    opts = parser.parse_args()
    summary = []
    with tempfile.TemporaryDirectory(prefix="muon_vs_adamw_") as tmp:
        for procs in map(int, opts.procs.split(",")):
            seconds, val = {}, {}
            for optimizer in ("AdamW", "Muon"):
                folder = Path(tmp) / f"{optimizer}_{procs}"
                rows = train(optimizer, procs, opts.steps, opts.val_freq, opts.val_steps, folder)
                # tokens_seen is per data-parallel rank; every rank is one here (FSDP over all of them)
                val[optimizer] = {r["tokens_seen"] * procs: r["val_loss"] for r in rows if "val_loss" in r}
                seconds[optimizer] = step_seconds(rows, opts.skip)
                print(f"{procs} proc {optimizer:5s}  validation loss by global tokens {val[optimizer]}  median step "
                      f"{seconds[optimizer] * 1e3:.1f} ms", flush=True)
            summary.append((procs, val, seconds))
    print("\nClosing note (validation loss at the same tokens: a report, not a target)")
    for procs, val, _ in summary:
        for tokens in sorted(val["AdamW"].keys() & val["Muon"].keys()):
            a, m = val["AdamW"][tokens], val["Muon"][tokens]
            print(f"  {procs} proc, {tokens:>9,} tokens: val loss AdamW {a:.4f}  Muon {m:.4f}  Muon/AdamW {m / a:.3f}")
    for procs, _, seconds in summary:
        ratio = seconds["Muon"] / seconds["AdamW"]
        print(f"  {procs} proc: median step AdamW {seconds['AdamW'] * 1e3:.1f} ms, Muon "
              f"{seconds['Muon'] * 1e3:.1f} ms: Muon/AdamW {ratio:.3f} (overhead {ratio - 1:+.1%})")


if __name__ == "__main__":
    main()

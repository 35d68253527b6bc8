"""Seconds `titanctl estimate-memory` takes for a pipelined recipe at 8 and at 32 microbatches.

The default is Llama 3.1 405B on 512 ranks under PP 8 with the 1F1B schedule (FSDP 8 x TP 8 inside
each stage), local batches of 1-sample microbatches (--counts, default 8 and 32). Each estimate
runs in a fresh process (as a user's would); the counts alternate over --rounds rounds so that load
from other processes hits all alike. Prints each run's seconds (the estimator's own figure, the
process's wall time including imports, and its CPU time, which load from other processes inflates
less), the load average and the exact peak, then the medians and their ratios to the first count: past the
schedule's warm-up the cost does not grow with the microbatch count (add 256 to see it).
--unshortened adds runs with --all-layers --all-microbatches (every block and every microbatch
run; minutes) for comparison.

    .venv/bin/python benchmarks/estimate_memory_time.py [--rounds 2] [--counts 8,32] [--schedule 1F1B]
        [--pp 8] [--config recipes/llama3_405b.toml] [--world-size 512] [--unshortened]
    .venv/bin/python benchmarks/estimate_memory_time.py --config recipes/qwen3_moe_235b_a22b.toml --pp 2 --ep 8
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def estimate_seconds(opts, batch: int, *extra: str) -> tuple[float, float, float, int]:
    """(estimator seconds, process wall seconds, process CPU seconds, peak bytes) of one estimate in a
    fresh process."""
    argv = [
        sys.executable, "-m", "titanctl", "estimate-memory", "--config", opts.config,
        "--world-size", str(opts.world_size), "--json",
        "--parallelism.pipeline_parallel_degree", str(opts.pp),
        "--parallelism.pipeline_parallel_schedule", opts.schedule,
        "--parallelism.pipeline_parallel_microbatch_size", "1",
        "--training.local_batch_size", str(batch),
        "--parallelism.expert_parallel_degree", str(opts.ep), *extra,
    ]
    started, children = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
    if proc.returncode:
        raise SystemExit(f"estimate-memory failed:\n{proc.stderr}")
    out = json.loads(proc.stdout[proc.stdout.index("{"):])
    return out["seconds"], wall, cpu, out["peak"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="recipes/llama3_405b.toml")
    parser.add_argument("--world-size", type=int, default=512)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel degree (MoE recipes)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--counts", default="8,32", help="microbatch counts, comma-separated")
    parser.add_argument("--unshortened", action="store_true", help="also run every block and microbatch")
    opts = parser.parse_args()

    counts = [int(c) for c in opts.counts.split(",")]
    variants = {f"{n} microbatches": (n,) for n in counts}
    if opts.unshortened:
        for n in counts:
            variants[f"{n} microbatches, unshortened"] = (n, "--all-layers", "--all-microbatches")
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    peaks: dict[str, int] = {}
    print(f"{opts.config} on {opts.world_size} ranks, pp {opts.pp}, ep {opts.ep}, {opts.schedule}, "
          "microbatches of 1 sample")
    for round_ in range(1, opts.rounds + 1):
        for name, (batch, *extra) in variants.items():
            estimator, wall, cpu, peaks[name] = estimate_seconds(opts, batch, *extra)
            seconds[name].append(estimator)
            print(f"round {round_}: {name:30s} {estimator:6.1f} s estimating, {wall:6.1f} s wall, {cpu:6.1f} s CPU, "
                  f"load {os.getloadavg()[0]:.1f}, peak {peaks[name]:,} bytes", flush=True)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    print()
    for name, value in median.items():
        print(f"median {name:30s} {value:6.1f} s")
    base = median[f"{counts[0]} microbatches"]
    for n in counts[1:]:
        print(f"ratio {n} / {counts[0]} microbatches: {median[f'{n} microbatches'] / base:.2f}")
    if opts.unshortened:
        for n in counts:
            full, short = median[f"{n} microbatches, unshortened"], median[f"{n} microbatches"]
            same = peaks[f"{n} microbatches, unshortened"] == peaks[f"{n} microbatches"]
            print(f"{n} microbatches: unshortened / shortened {full / short:.2f}, same peak: {same}")


if __name__ == "__main__":
    main()

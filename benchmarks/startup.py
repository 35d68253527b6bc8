"""CPU-seconds a fresh process takes to import titanctl's training stack, with the cyclic garbage
collector paused during the import (titanctl.gc_pauses.heavy_imports, what every titanctl command and
the test workers do) relative to the collector left running.

Each round starts one interpreter of each kind (alternating, so that load from other processes hits
both alike) and reads its CPU time from the kernel; the ratio printed is the median of the rounds'.

    .venv/bin/python benchmarks/startup.py [--rounds 7] [--module titanctl.train.trainer]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cpu_seconds(code: str) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--module", default="titanctl.train.trainer")
    args = parser.parse_args()
    plain = f"import {args.module}"
    paused = f"from titanctl.gc_pauses import heavy_imports\nwith heavy_imports():\n    import {args.module}"
    rows = []
    for _ in range(args.rounds):
        rows.append((cpu_seconds(plain), cpu_seconds(paused)))
    running = statistics.median(r[0] for r in rows)
    frozen = statistics.median(r[1] for r in rows)
    print(f"import {args.module}, CPU-seconds, median of {args.rounds} rounds")
    print(f"  collector running: {running:.2f}")
    print(f"  collector paused:  {frozen:.2f}")
    print(f"  paused / running:  {statistics.median(r[1] / r[0] for r in rows):.2f}")


if __name__ == "__main__":
    main()

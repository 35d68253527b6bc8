"""Does `titanctl plan`'s cost model rank layouts as this machine runs them? Predicted vs measured step times.

Calibrates the machine with `titanctl plan --calibrate --gpus 4` (or reuses --cluster FILE when it
exists), then for each layout of recipes/llama3_debug.toml on 4 processes (FSDP, HSDP, DDP, TP, CP,
2-D, PP under three schedules) asks the planner's cost model for its step time and measures it:
`torchrun --nproc_per_node 4 -m titanctl train` for --steps steps (compile off, fp32, the recipe's
global batch of 32 x 256), the median step_time of metrics.jsonl after --warmup steps. Layouts run
in alternating rounds (--rounds) so that load from other processes hits all alike; a layout's
measured time is the median over rounds. Prints both, each layout's error (predicted / measured - 1)
and the Spearman rank correlation.

    PYTHONPATH=. .venv/bin/python benchmarks/plan_accuracy.py [--cluster outputs/plan/cpu4.toml]
        [--recalibrate] [--steps 8] [--warmup 3] [--rounds 1] [--only NAME,NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "llama3_debug.toml"
GLOBAL_BATCH = 32
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TIKTOKEN_CACHE_DIR": ""}


def layouts():
    from titanctl.planning.plan.candidates import Candidate

    # Candidate(dp_replicate, dp_shard, tp, pp, cp, ep, local_batch_size, grad_accum, ...)
    return {
        "fsdp4": Candidate(1, 4, 1, 1, 1, 1, 8, 1, ac="none"),
        "hsdp2x2": Candidate(2, 2, 1, 1, 1, 1, 8, 1, ac="none"),
        "ddp4": Candidate(4, 1, 1, 1, 1, 1, 8, 1, ac="none"),
        "tp4": Candidate(1, 1, 4, 1, 1, 1, 8, 4, ac="none"),
        "fsdp2_tp2": Candidate(1, 2, 2, 1, 1, 1, 8, 2, ac="none"),
        "fsdp2_cp2": Candidate(1, 2, 1, 1, 2, 1, 8, 2, ac="none"),
        "fsdp2_pp2_1f1b": Candidate(1, 2, 1, 2, 1, 1, 16, 1, pp_schedule="1F1B", pp_microbatch_size=4, ac="none"),
        "fsdp2_pp2_gpipe": Candidate(1, 2, 1, 2, 1, 1, 16, 1, pp_schedule="GPipe", pp_microbatch_size=4, ac="none"),
        "fsdp2_pp2_interleaved": Candidate(1, 2, 1, 2, 1, 1, 16, 1, pp_schedule="Interleaved1F1B",
                                           pp_microbatch_size=4, ac="none"),
    }


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):  # ties share their mean rank
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def measure(candidate, steps: int, warmup: int, folder: Path) -> float:
    args = candidate.overrides(GLOBAL_BATCH) + [
        "--compile.enable", "false", "--checkpoint.enable_checkpoint", "false",
        "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1", "--training.steps", str(steps),
        "--job.dump_folder", str(folder),
    ]
    env = {**os.environ, **OFFLINE, "HF_HOME": str(folder / "hf"), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           "-m", "titanctl", "train", "--config", str(RECIPE), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    if proc.returncode:
        raise SystemExit(f"training failed ({' '.join(cmd)}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time"] for r in rows if r["step"] > warmup]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default=str(REPO / "outputs" / "plan" / "cpu4.toml"))
    parser.add_argument("--recalibrate", action="store_true", help="calibrate even if --cluster exists")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median (the first is compile"
                        "-free warm-up, the next settle the allocator)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", default="", help="comma-separated layout names")
    parser.add_argument("--predict-only", action="store_true")
    opts = parser.parse_args()

    cluster = Path(opts.cluster)
    if opts.recalibrate or not cluster.exists():
        cluster.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "titanctl", "plan", "--calibrate", "--gpus", "4", "--cluster",
                        str(cluster)], check=True, cwd=REPO, env={**os.environ, **OFFLINE})
        print(f"calibrated in {time.perf_counter() - started:.0f} s -> {cluster}")
    from titanctl.planning.plan.devices import resolve_device
    from titanctl.planning.plan.search import evaluate_layouts, recipe_config

    device = resolve_device(None, cluster, {})
    chosen = layouts()
    if opts.only:
        chosen = {name: chosen[name] for name in opts.only.split(",")}
    cfg = recipe_config(RECIPE)
    cfg.compile.enable = False
    predicted = {name: layout for name, layout in
                 zip(chosen, evaluate_layouts(str(RECIPE), cfg, device, list(chosen.values()), GLOBAL_BATCH))}
    measured: dict[str, list[float]] = {name: [] for name in chosen}
    if not opts.predict_only:
        with tempfile.TemporaryDirectory() as tmp:
            for round_ in range(opts.rounds):
                for name, candidate in chosen.items():
                    folder = Path(tmp) / f"{name}-{round_}"
                    measured[name].append(measure(candidate, opts.steps, opts.warmup, folder))
                    print(f"  round {round_ + 1} {name}: {measured[name][-1]:.3f} s", flush=True)
    print(f"\nllama3 debug model on 4 CPU processes, global batch {GLOBAL_BATCH} x 256, fp32, compile off; "
          f"cluster file {cluster}")
    print(f"{'layout':24s}{'predicted s':>12s}{'measured s':>12s}{'error':>9s}   dominant (predicted)")
    pred, meas = [], []
    for name, layout in predicted.items():
        p = layout.time.step
        m = statistics.median(measured[name]) if measured[name] else float("nan")
        pred.append(p)
        meas.append(m)
        print(f"{name:24s}{p:12.3f}{m:12.3f}{(p / m - 1):+9.1%}   {layout.time.dominant}: "
              + ", ".join(f"{k} {v:.3f}" for k, v in sorted(layout.time.terms.items(), key=lambda kv: -kv[1])[:4]))
    if not opts.predict_only:
        errors = [abs(p / m - 1) for p, m in zip(pred, meas)]
        print(f"Spearman rank correlation {spearman(pred, meas):.3f}; error max {max(errors):.1%}, "
              f"median {statistics.median(errors):.1%}; within 30%: {sum(e <= 0.3 for e in errors)}/{len(errors)}")


if __name__ == "__main__":
    main()

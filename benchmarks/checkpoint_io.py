"""Checkpoint save/load times of the debug model (full training state), sync vs async, and
what a resume costs from process start to the end of the first step.

Sync: training waits for the whole write. Async: training waits only for the staging copy
("blocking"); the write finishes in the background ("durable"). Each number is the median of
--rounds rounds, sync and async alternating so that load from other processes hits both alike.

    .venv/bin/python benchmarks/checkpoint_io.py [--rounds 3] [--flavor debugmodel] [--seq-len 256] [--keep]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def overrides(opts, dump: Path, *extra: str) -> list[str]:
    return [
        "--model.flavor", opts.flavor,
        "--training.seq_len", str(opts.seq_len),
        "--training.local_batch_size", "8",
        "--training.steps", "100000",
        "--training.mixed_precision_param", "float32",
        "--activation_checkpoint.mode", "none",
        "--metrics.log_freq", "100000",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval", "100000",
        "--checkpoint.keep_latest_k", "1",
        "--job.dump_folder", str(dump),
        *extra,
    ]


def folder_mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.iterdir()) / 2**20


def child(argv: list[str]) -> None:
    """One process: import, build the Trainer (loading a checkpoint if there is one), one step."""
    t_start = time.time()
    from titanctl.config.loader import load_config
    from titanctl.train.trainer import Trainer

    t_imported = time.time()
    trainer = Trainer(load_config(None, argv))
    t_ready = time.time()
    trainer.train_step()
    t_step = time.time()
    print(json.dumps({"start": t_start, "imported": t_imported, "ready": t_ready, "first_step": t_step,
                      "resumed_step": trainer.step}))
    sys.stdout.flush()
    os._exit(0)


def time_process(argv: list[str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    launched = time.time()
    proc = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout + proc.stderr)
    marks = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "python + imports": marks["imported"] - launched,
        "build (+ load)": marks["ready"] - marks["imported"],
        "first step": marks["first_step"] - marks["ready"],
        "start to first step": marks["first_step"] - launched,
        "resumed_step": marks["resumed_step"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint folders it wrote")
    parser.add_argument("--child", nargs=argparse.REMAINDER)
    opts = parser.parse_args()
    if opts.child is not None:
        return child(opts.child)

    from titanctl.checkpoint.manager import CheckpointManager
    from titanctl.config.loader import load_config
    from titanctl.train.trainer import Trainer

    work = Path(tempfile.mkdtemp(prefix="titanctl-ckpt-bench-"))
    cfg = load_config(None, overrides(opts, work / "run"))
    trainer = Trainer(cfg)
    trainer.train_step()  # optimizer state exists: a full training checkpoint
    trainer.step = 1
    quiet = lambda text: None  # noqa: E731
    common = dict(
        model_parts=trainer.model_parts, optimizer=trainer.optimizer, lr_scheduler=trainer.lr_scheduler,
        loader=trainer.loader, model_args=trainer.model_args, rank=0, world_size=1, dp_degree=1,
        device=trainer.env.device, log=quiet,
    )
    sync = CheckpointManager(cfg, **common)
    async_cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, async_mode="async"))
    asynchronous = CheckpointManager(async_cfg, **common)

    step_alone, step_during_write = [], []
    sync_s, async_blocking, async_durable, load_s = [], [], [], []
    step = 1
    for _ in range(opts.rounds):
        step += 1
        start = time.perf_counter()
        sync.save(step, 0)
        sync_s.append(time.perf_counter() - start)

        start = time.perf_counter()
        trainer.train_step()
        step_alone.append(time.perf_counter() - start)

        step += 1
        asynchronous.save(step, 0)
        start = time.perf_counter()
        trainer.train_step()  # overlaps the background write
        step_during_write.append(time.perf_counter() - start)
        asynchronous.wait()
        timing = asynchronous.timings[-1]
        async_blocking.append(timing.blocking_s)
        async_durable.append(timing.durable_s)

        start = time.perf_counter()
        sync.load()
        load_s.append(time.perf_counter() - start)
    asynchronous.close()
    size = folder_mib(work / "run" / "checkpoint" / f"step-{step}")

    med = statistics.median
    print(f"\n{opts.flavor}: {trainer.model_args.num_params() / 1e6:.1f}M params, full training state "
          f"{size:.1f} MiB on disk, device {trainer.env.device}, {opts.rounds} rounds (median)")
    print(f"  sync save (training waits for all of it)      {med(sync_s):7.3f} s")
    print(f"  async save: training waits (staging copy)      {med(async_blocking):7.3f} s   "
          f"{med(async_blocking) / med(sync_s):5.2f} x sync")
    print(f"  async save: until durable (step-N renamed)     {med(async_durable):7.3f} s   "
          f"{med(async_durable) / med(sync_s):5.2f} x sync (with one training step running beside it)")
    print(f"  training step alone / during an async write    {med(step_alone):7.3f} s / "
          f"{med(step_during_write):.3f} s   {med(step_during_write) / med(step_alone):5.2f} x")
    print(f"  load (full state, in process)                  {med(load_s):7.3f} s   "
          f"{med(load_s) / med(sync_s):5.2f} x sync save")

    # Resume cost: a fresh process that starts from scratch vs one that resumes the checkpoint.
    fresh_runs, resume_runs = [], []
    for i in range(max(2, opts.rounds - 1)):
        fresh_runs.append(time_process(overrides(opts, work / f"fresh{i}")))
        resume_runs.append(time_process(overrides(opts, work / "run")))
    assert all(r["resumed_step"] == step for r in resume_runs), resume_runs
    print(f"\n  process start to end of first step ({len(fresh_runs)} rounds, median)   fresh     resumed   ratio")
    for key in ("python + imports", "build (+ load)", "first step", "start to first step"):
        f, r = med(x[key] for x in fresh_runs), med(x[key] for x in resume_runs)
        print(f"    {key:<28}                      {f:7.2f} s {r:7.2f} s  {r / f:5.2f} x")
    if opts.keep:
        print(f"\n  (folders kept under {work})")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":  # spawned helpers re-import this module
    main()

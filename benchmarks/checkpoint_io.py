"""Checkpoint save/load times of the debug model (full training state), sync vs async, what a
resume costs from process start to the end of the first step, and what checksums cost.

Sync: training waits for the whole write. Async: training waits only for the staging copy
("blocking"); the write finishes in the background ("durable"). Each number is the median of
--rounds rounds, sync and async alternating so that load from other processes hits both alike.

Checksums (--part checksums): the same DCP save and load through titanctl's writer and reader,
with and without the SHA-256 of every file (hashed by the writer once written; verified by the
reader before loading), for the debug model's full training state and for the weights of an
8B-shaped model cut to 2 layers (dim 4096, 32 heads, 8 KV heads, 8B's FFN, vocab 128256; bf16,
3.1 GB). Loads follow saves, so files come from the page cache: the hashing is the whole cost.

    .venv/bin/python benchmarks/checkpoint_io.py [--rounds 3] [--flavor debugmodel] [--seq-len 256] [--keep]
        [--part all|io|checksums]
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
    from titanctl.config.recipe import load_config
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
    parser.add_argument("--part", choices=("all", "io", "checksums"), default="all")
    parser.add_argument("--child", nargs=argparse.REMAINDER)
    opts = parser.parse_args()
    if opts.child is not None:
        return child(opts.child)
    if opts.part in ("all", "io"):
        io_costs(opts)
    if opts.part in ("all", "checksums"):
        checksum_costs(opts)


def io_costs(opts) -> None:
    from titanctl.checkpoint.run.manager import CheckpointManager
    from titanctl.config.recipe import load_config
    from titanctl.models.shapes import num_params
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
    print(f"\n{opts.flavor}: {num_params(trainer.model_args) / 1e6:.1f}M params, full training state "
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


# ----------------------------------------------------------------------------- checksums


def _timed_save(state: dict, folder: Path, args, checksummed: bool) -> float:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from titanctl.checkpoint.trust.checksums import ChecksumWriter, digest_files, record
    from titanctl.checkpoint.trust.metadata import write_metadata
    from titanctl.checkpoint.trust.reader import quiet_dcp

    start = time.perf_counter()
    writer = (ChecksumWriter if checksummed else FileSystemWriter)(str(folder), sync_files=True)
    with quiet_dcp():
        dcp.save(state, storage_writer=writer, no_dist=True)
    extra = {"checksums": record({**writer.checksums, **digest_files(folder, [".metadata"])})} if checksummed else {}
    write_metadata(folder, args, step=1, weights_only=True, dtype="float32", **extra)
    return time.perf_counter() - start


def _timed_load(state: dict, folder: Path, checksummed: bool) -> float:
    from titanctl.checkpoint.trust.reader import DCPFolder

    start = time.perf_counter()
    source = DCPFolder(folder)  # verifies .metadata's checksum when one is recorded
    assert source.verified == checksummed
    source.verify()  # the data files' checksums (when recorded), then the non-tensor items
    source.load(state)
    return time.perf_counter() - start


def _checksum_rows(label: str, state: dict, load_into: dict, args, work: Path, rounds: int) -> None:
    from titanctl.checkpoint.trust.checksums import digest_files

    nbytes = 0
    times: dict[str, list[float]] = {}
    # Round 0 warms up (allocator, page cache) and is not counted.
    for i in range(rounds + 1):
        for checksummed in (False, True):  # alternate, so that machine load hits both alike
            folder = work / f"{label}-{i}-{checksummed}"
            save = _timed_save(state, folder, args, checksummed)
            load = _timed_load(load_into, folder, checksummed)
            nbytes = sum(p.stat().st_size for p in folder.iterdir())
            if i > 0:
                times.setdefault(f"save{checksummed}", []).append(save)
                times.setdefault(f"load{checksummed}", []).append(load)
                if checksummed:
                    start = time.perf_counter()
                    digest_files(folder, sorted(p.name for p in folder.iterdir()))
                    times.setdefault("hash", []).append(time.perf_counter() - start)
            shutil.rmtree(folder)
    med = {key: statistics.median(values) for key, values in times.items()}
    gib = nbytes / 2**30
    print(f"\n  {label}: {nbytes / 2**20:,.0f} MiB on disk, {rounds} round(s) (median)")
    hashing = med["hash"]
    print(f"    sha256 of its files alone                        {hashing:7.2f} s  ({gib / hashing:.2f} GiB/s)")
    print("                                                   without    with checksums")
    for what in ("save", "load"):
        plain, hashed = med[f"{what}False"], med[f"{what}True"]
        print(f"    {what} (sync, one process)                      {plain:7.2f} s  {hashed:7.2f} s   "
              f"{hashed - plain:+6.2f} s ({100 * (hashed - plain) / plain:+.0f}%)")


def checksum_costs(opts) -> None:
    import torch

    from titanctl.checkpoint.run.manager import STATE_PARTS, CheckpointManager
    from titanctl.config.recipe import load_config
    from titanctl.models.common.decoder import Transformer
    from titanctl.models.llama.args import LLAMA3_FLAVORS
    from titanctl.train.trainer import Trainer

    work = Path(tempfile.mkdtemp(prefix="titanctl-checksum-bench-"))
    print(f"\nchecksums: sha256 (hashlib), files hot in the page cache, {torch.get_num_threads()} threads")
    try:
        # The debug model's full training state, as the CheckpointManager hands it to DCP.
        cfg = load_config(None, overrides(opts, work / "run"))
        trainer = Trainer(cfg)
        trainer.train_step()  # optimizer state exists
        manager = CheckpointManager(
            cfg, model_parts=trainer.model_parts, optimizer=trainer.optimizer, lr_scheduler=trainer.lr_scheduler,
            loader=trainer.loader, model_args=trainer.model_args, rank=0, world_size=1, dp_degree=1,
            device=trainer.env.device, log=lambda text: None,
        )
        full = manager._dcp_state(list(STATE_PARTS))
        _checksum_rows(f"{opts.flavor}, full training state", full, manager._dcp_state(list(STATE_PARTS)),
                       trainer.model_args, work, opts.rounds)
        del trainer, manager, full

        # An 8B-shaped model cut to 2 layers: its embedding and output dominate (2 x 1.05 GB in bf16).
        args = LLAMA3_FLAVORS["8B"].replace(n_layers=2, vocab_size=128256, max_seq_len=16)
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in Transformer(args).state_dict().items()}
        weights = {k: torch.randn(shape, dtype=torch.bfloat16) for k, shape in shapes.items()}
        target = {k: torch.empty(shape, dtype=torch.bfloat16) for k, shape in shapes.items()}
        _checksum_rows("8B-shaped, 2 layers, bf16 weights", weights, target, args, work, opts.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":  # spawned helpers re-import this module
    main()

"""A few distributed training steps under the installed torch: one process, FSDP 2 and TP 2.

Run by scripts/test_torch.sh after the in-process tests, to show that torch's distributed paths
(device mesh, FSDP2, DTensor TP, gloo, torch.compile) import and train under another torch release:
the in-process tests start no process. Each run is `torchrun -m titanctl train` on the debug recipe
(2 layers, fp32, 3 steps); the sharded runs' losses must equal the single process's within 1e-5
relative, as the distributed tests require. Exits non-zero on any failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = [
    "--config", "recipes/llama3_debug.toml",
    "--model.n_layers", "2",
    "--training.mixed_precision_param", "float32",
    "--training.steps", "3",
    "--training.global_batch_size", "8",
    "--checkpoint.enable_checkpoint", "false",
    "--metrics.enable_tensorboard", "false",
]
# (name, processes, overrides); 8 sequences per step in each.
RUNS = [
    ("one process", 1, ["--training.local_batch_size", "8"]),
    ("FSDP 2", 2, ["--training.local_batch_size", "4", "--parallelism.data_parallel_shard_degree", "2"]),
    ("TP 2", 2, ["--training.local_batch_size", "8", "--parallelism.data_parallel_shard_degree", "1",
                 "--parallelism.tensor_parallel_degree", "2"]),
]
TOLERANCE = 1e-5


def train(nproc: int, overrides: list[str], folder: Path) -> list[float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TIKTOKEN_CACHE_DIR": "", "HF_HOME": str(folder / "hf"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "titanctl", "train", *COMMON, *overrides, "--job.dump_folder", str(folder)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def main() -> int:
    failures = 0
    reference = None
    with tempfile.TemporaryDirectory(prefix="titanctl-smoke-") as tmp:
        for i, (name, nproc, overrides) in enumerate(RUNS):
            start = time.perf_counter()
            try:
                got = train(nproc, overrides, Path(tmp) / str(i))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"FAIL {name}: {e}")
                if reference is None:  # nothing to compare the others with
                    return 1
                failures += 1
                continue
            seconds = time.perf_counter() - start
            if reference is None:
                reference = got
                print(f"ok   {name:12s} losses {[round(x, 6) for x in got]}  {seconds:.0f} s")
                continue
            diff = max(abs(a - b) / abs(b) for a, b in zip(got, reference)) if len(got) == len(reference) else 1.0
            ok = diff <= TOLERANCE
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name:12s} max rel loss diff vs one process {diff:.1e}  {seconds:.0f} s")
    print(f"smoke: {len(RUNS) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

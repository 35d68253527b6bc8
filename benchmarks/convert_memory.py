"""Peak memory (RSS) of `titanctl convert` on the debug model and on a synthetic large checkpoint.

Each conversion runs in its own subprocess, which reports its peak RSS after importing
(the baseline: python, torch, DCP, safetensors) and after converting, so the difference
is what converting cost. The peak is the kernel's high-water mark of the process's own
memory (``VmHWM``); ``ru_maxrss`` is not used because after fork+exec it starts from the
parent's RSS (this script's, which just built a multi-GB checkpoint). The large model has Llama 3.1 8B's shapes
(dim 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256) but fewer layers, in bf16:
``--layers 2`` gives 1.48 B parameters, 2.96 GB, whose largest tensors (embedding,
output) are 1.05 GB each.

    python benchmarks/convert_memory.py                # debug model + 2-layer 8B-shaped model
    python benchmarks/convert_memory.py --layers 0     # debug model only
    python benchmarks/convert_memory.py --keep DIR     # keep the generated checkpoints in DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys, time
from titanctl.checkpoint.convert import convert_checkpoint
import titanctl.checkpoint.formats  # noqa: F401  (torch, DCP, safetensors: the baseline imports)
import titanctl.models.llama, titanctl.config.recipe  # noqa: F401

def hwm_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

base = hwm_kib()
spec = json.loads(sys.argv[1])
if spec.get("src"):
    start = time.perf_counter()
    report = convert_checkpoint(spec["src"], spec["dst"], dst_format=spec["to"], **spec.get("options", {}))
    seconds = time.perf_counter() - start
else:
    seconds = 0.0
peak = hwm_kib()
print(json.dumps({"baseline_kib": base, "peak_kib": peak, "seconds": seconds}))
"""


def measure(src: Path | None, dst: Path | None, to: str | None, **options) -> dict:
    spec = {"src": str(src) if src else None, "dst": str(dst) if dst else None, "to": to, "options": options}
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], capture_output=True, text=True,
                         env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"conversion {src} -> {to} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def build(folder: Path, fmt: str, args, dtype, **options) -> None:
    """Write a random checkpoint with the formats' own writers, one tensor drawn at a time."""
    import torch

    from titanctl.checkpoint.convert import write_checkpoint
    from titanctl.checkpoint.formats.base import Source, TensorInfo
    from titanctl.models.shapes import weight_shapes

    class RandomSource(Source):
        format = "random"

        def __init__(self):
            super().__init__(Path("<random>"))
            self.args = args
            self.infos = [TensorInfo(n, s, dtype, n, "random") for n, s in weight_shapes(args).items()]

        def own_args(self):
            return args, "random"

        def vocab_size(self, dim):
            return args.vocab_size

        def bind(self, args, origin):
            pass

        def load(self, name):
            gen = torch.Generator().manual_seed(hash(name) % 2**31)
            return torch.randn(self.info(name).shape, generator=gen, dtype=torch.float32).to(dtype) * 0.02

    write_checkpoint(RandomSource(), folder, fmt, **options)


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if abs(nbytes) >= 1e9 else f"{nbytes / 1e6:.0f} MB"


def run_suite(name: str, root: Path, args, dtype) -> list[tuple]:
    import torch

    from titanctl.models.shapes import weight_shapes

    sizes = {n: torch.Size(s).numel() * dtype.itemsize for n, s in weight_shapes(args).items()}
    total, largest = sum(sizes.values()), max(sizes.values())
    print(f"\n{name}: {args.n_layers} layers, dim {args.dim}, vocab {args.vocab_size}, {dtype}: "
          f"model {gb(total)}, largest tensor {gb(largest)}", flush=True)
    t = time.perf_counter()
    for folder, shards in (("meta1", 1), ("meta2", 2)):
        if not (root / folder).is_dir():  # reused from an earlier --keep run
            build(root / folder, "meta", args, dtype, shards=shards)
    print(f"  (meta 1-shard and 2-shard sources ready in {time.perf_counter() - t:.0f} s)", flush=True)
    steps = [
        ("meta (1 shard) -> dcp", "meta1", "dcp", "dcp", {}),
        ("dcp -> hf (--max-shard-size 1GB)", "dcp", "hf", "hf", {"max_shard_size": "1GB"}),
        ("hf -> meta (--shards 2)", "hf", "meta_from_hf", "meta", {"shards": 2}),
        ("meta (2 shards) -> dcp", "meta2", "dcp2", "dcp", {}),
        ("meta (2 shards) -> hf (5GB shards)", "meta2", "hf2", "hf", {}),
        ("dcp -> torchtune (one file)", "dcp", "tt", "torchtune", {}),
    ]
    rows = []
    for label, src, dst, to, options in steps:
        shutil.rmtree(root / dst, ignore_errors=True)
        r = measure(root / src, root / dst, to, **options)
        extra = (r["peak_kib"] - r["baseline_kib"]) * 1024
        rows.append((name, label, r["peak_kib"] * 1024, extra, r["seconds"], total, largest))
        print(f"  {label:38s} peak RSS {gb(r['peak_kib'] * 1024):>9s}  above baseline {gb(extra):>8s}  "
              f"({extra / total:4.0%} of the model)  {r['seconds']:6.1f} s", flush=True)
        for done in {"hf": ["dcp2"], "tt": ["hf", "meta_from_hf", "hf2"]}.get(dst, []):
            shutil.rmtree(root / done, ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="Layers of the 8B-shaped model (0: skip it).")
    parser.add_argument("--keep", type=Path, help="Folder to build the checkpoints in (kept).")
    opts = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import torch

    from titanctl.models.llama.args import LLAMA3_FLAVORS
    root = opts.keep or Path(tempfile.mkdtemp(prefix="titanctl-convert-mem-"))
    try:
        base = measure(None, None, None)
        print(f"baseline (python + torch + titanctl imports): peak RSS {gb(base['peak_kib'] * 1024)}")
        (root / "debug").mkdir(parents=True, exist_ok=True)
        run_suite("debug model", root / "debug", LLAMA3_FLAVORS["debugmodel"].replace(vocab_size=4352), torch.float32)
        if opts.layers:
            (root / "large").mkdir(parents=True, exist_ok=True)
            args = LLAMA3_FLAVORS["8B"].replace(vocab_size=128256, n_layers=opts.layers)
            run_suite(f"8B-shaped, {opts.layers} layers", root / "large", args, torch.bfloat16)
    finally:
        if not opts.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Per-rank peak memory of a training step (forward + backward) of the debug model under a document mask, for
context parallel 1, 2 and 4, with the masked ring (titanctl/parallel/layouts/masked_ring.py) and with the route it
replaced (every rank all-gathers the whole sequence's keys and values, attends its queries to them).

Each CP degree runs as that many gloo processes on this machine; each runs the step ``titanctl train`` runs
(``ForwardBackward`` from the recipe, fp32, no activation checkpointing, FSDP over the CP ranks as train does,
the mask built from the tokens) once under torch's ``MemTracker``, which sees every tensor storage an op makes.
Printed per CP degree and route: the largest rank's peak of the whole step, the same less weights, gradients and
optimizer state ("activations": what grows with the sequence), and both as ratios to CP 1 (the goal of issue 61:
CP 4 activations <= 0.3 x CP 1) and ring / all-gather. Memory, not time: the figures do not depend on the load.
Tokens: random, a BOS (a new document) with probability 1 / --doc-len at each position, the same on every run.

    PYTHONPATH=. .venv/bin/python benchmarks/cp_memory.py [--seq-len 16384] [--doc-len 2048] \\
        [--cps 1,2,4] [--routes ring]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titanctl import _torch_compat
from titanctl.config.recipe import load_config
from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from titanctl.models.common.attention import AttentionKernel
from titanctl.models.registry import model_args_from_config
from titanctl.parallel.layouts.build import build_model_parts
from titanctl.parallel.layouts.dims import ParallelDims
from titanctl.train.step import ForwardBackward

REPO = Path(__file__).resolve().parents[1]
ROUTES = ("ring", "allgather")  # at CP 1 neither: one process attends under the whole mask
WEIGHTS = ("Parameter", "Buffer", "Gradient", "Optstate")  # MemTracker's categories that do not grow with T


def all_gather_route(model: torch.nn.Module, cp_mesh) -> None:
    """The route before the masked ring: each kernel given a mask first all-gathers every rank's K and V."""
    gather = _torch_compat.CP_ALL_GATHER_AUTOGRAD.get()

    def gather_keys_and_values(module, args):
        q, k, v, *mask = args
        if not mask or mask[0] is None:
            return None
        return (q, gather(k.contiguous(), 2, cp_mesh), gather(v.contiguous(), 2, cp_mesh), *mask)

    for module in model.modules():
        if isinstance(module, AttentionKernel):
            module.__dict__.pop("forward", None)  # the kernel's own forward back, not the ring's
            module.register_forward_pre_hook(gather_keys_and_values)


def run_rank(rank: int, cp: int, route: str, opts, port: int, folder: str) -> None:
    if cp > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=cp)
    torch.set_num_threads(max(1, opts.threads // cp))
    overrides = ["--training.local_batch_size", "1", "--training.global_batch_size", "1",
                 "--training.seq_len", str(opts.seq_len), "--training.mixed_precision_param", "float32",
                 "--activation_checkpoint.mode", "none", "--compile.enable", "false",
                 "--model.attn_mask_type", "block_causal", "--parallelism.data_parallel_shard_degree", "1",
                 "--parallelism.context_parallel_degree", str(cp)]  # fmt: skip
    cfg = load_config(opts.recipe, overrides)
    tokenizer = Tokenizer(cfg.model.tokenizer_path or DEFAULT_TOKENIZER_PATH)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, tokenizer.vocab_size, (1, opts.seq_len + 1), generator=gen)
    tokens[tokens == tokenizer.bos_id] = 0
    tokens[torch.rand(tokens.shape, generator=gen) < 1 / opts.doc_len] = tokenizer.bos_id
    tokens[0, 0] = tokenizer.bos_id
    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()

    dims = ParallelDims.from_config(cfg.parallelism, cp)
    args = model_args_from_config(cfg.model, tokenizer.vocab_size, opts.seq_len)
    cpu = torch.device("cpu")
    parts = build_model_parts(cfg, dims, args, cpu).parts
    forward_backward = ForwardBackward(cfg, dims, parts, None, cpu, bos_id=tokenizer.bos_id)
    if cp > 1 and route == "allgather":
        all_gather_route(parts[0], dims.mesh["cp"])
    tracker = _torch_compat.MEM_TRACKER.get()()
    tracker.track_external(*parts)
    with tracker:
        forward_backward([(inputs, labels)])
    peak = {}
    for by_category in tracker.get_tracker_snapshot("peak").values():
        for category, nbytes in by_category.items():
            name = getattr(category, "value", category)  # torch's categories are str enums
            peak[name] = peak.get(name, 0) + nbytes
    total = peak.get("Total", sum(peak.values()))
    result = {"total": total, "activations": total - sum(peak.get(name, 0) for name in WEIGHTS)}
    Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    if cp > 1:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(cp: int, route: str, opts) -> dict[str, int]:
    """The largest rank's peaks (bytes)."""
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(run_rank, args=(cp, route, opts, free_port(), folder), nprocs=cp, join=True)
        ranks = [json.loads(p.read_text()) for p in Path(folder).glob("rank*.json")]
    return {key: max(r[key] for r in ranks) for key in ("total", "activations")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes/llama3_debug.toml"))
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--doc-len", type=int, default=2048, help="mean document length in tokens")
    parser.add_argument("--cps", default="1,2,4", help="context parallel degrees, comma-separated")
    parser.add_argument("--routes", default=",".join(ROUTES), help="routes at CP > 1, comma-separated")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads, split over ranks")
    opts = parser.parse_args()
    cps = [int(c) for c in opts.cps.split(",")]

    results = {}
    for cp in cps:
        for route in opts.routes.split(",") if cp > 1 else ROUTES[:1]:
            results[cp, route] = measure(cp, route, opts)
            print(f"measured cp {cp} {route}: {results[cp, route]}", flush=True)
    base = results.get((1, "ring"))
    mib = 2**20
    print(f"\nllama3 debug model, seq {opts.seq_len}, batch 1, documents of {opts.doc_len} tokens on average, fp32; "
          f"per-rank peak of one forward + backward (the largest rank), MemTracker")
    print(f"{'cp':>3} {'route':>10} {'step MiB':>10} {'activ. MiB':>11} {'step/cp1':>9} {'activ./cp1':>11} "
          f"{'ring/allgather (activ.)':>24}")
    for (cp, route), got in results.items():
        step, act = got["total"], got["activations"]
        vs_base = "" if base is None else f"{step / base['total']:9.3f} {act / base['activations']:11.3f}"
        other = results.get((cp, "allgather"))
        vs_gather = f"{act / other['activations']:24.3f}" if route == "ring" and other else ""
        print(f"{cp:>3} {route if cp > 1 else '-':>10} {step / mib:10.1f} {act / mib:11.1f} {vs_base} {vs_gather}")

if __name__ == "__main__":
    main()

"""Context parallel's step figures that the machine's load cannot spoil: per rank, the peak memory and the CPU time
of a training step of the debug model for CP 1, 2 and 4, each method (ring, Ulysses, ulysses_ring) and mask
(causal, block_causal), as ratios to CP 1 of the same mask.

Each CP degree runs as that many gloo processes (torch threads: --threads / ranks each); each runs the step
``titanctl train`` runs (``ForwardBackward`` from the recipe: fp32, no activation checkpointing, FSDP over the
CP ranks as train does, the masks and the CP order built from the tokens) twice:

- the first under torch's ``MemTracker``, which sees every tensor storage an op makes: the step's peak, and the
  same less weights, gradients and optimizer state ("activations": what grows with the sequence);
- the second untracked, timed by the rank's CPU time (``time.process_time``: its own threads' work, not the
  waiting while other processes run; OpenMP's idle threads sleep, ``OMP_WAIT_POLICY=PASSIVE``, so spinning is
  not counted as work) and, for reference only, wall time (which on shared cores moves with the load).

Printed per row: the largest rank's CPU seconds and their sum over the ranks (the whole job's work: what the
method adds to one process's), the largest rank's activations and peak, the wall seconds, each also as a ratio
to CP 1 of the same mask, and the ``cp_imbalance`` the step measured (max rank's attention work / the mean).
Ideal: max-rank CPU and activations 1 / cp of CP 1, the sum 1.0 (issue 61's goal: CP 4 activations <= 0.3x).

Tokens: random; under block_causal the documents are the log-normal mix of benchmarks/context_parallel.py
(median 500 tokens, sigma 1.3), each starting with a BOS, the same on every run; ``--doc-len N`` instead starts
a document at each position with probability 1 / N (the mix of this benchmark's earlier tables). Method
``allgather`` (block_causal only) is the route the masked ring replaced: every rank all-gathers the whole
sequence's keys and values and attends its queries to them. ulysses_ring runs with
``context_parallel_ulysses_degree`` 2, so at CP 4 only (the degree must divide cp and be less than it).

    PYTHONPATH=. .venv/bin/python benchmarks/cp_steps.py [--seq-len 16384] [--cps 1,2,4] \\
        [--methods ring,ulysses,ulysses_ring] [--masks causal,block_causal] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from context_parallel import packed_doc_ids  # this folder is on sys.path when run as a script

from titanctl import _torch_compat
from titanctl.config.recipe import load_config
from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from titanctl.models.common.attention import AttentionKernel
from titanctl.models.registry import model_args_from_config
from titanctl.parallel.layouts.build import build_model_parts
from titanctl.parallel.layouts.cp_balance import imbalance
from titanctl.parallel.layouts.dims import ParallelDims
from titanctl.parallel.layouts.ring_mask import RingMask
from titanctl.train.step import ForwardBackward

REPO = Path(__file__).resolve().parents[1]
METHODS = ("ring", "ulysses", "ulysses_ring", "allgather")
MASKS = ("causal", "block_causal")
ULYSSES_DEGREE = 2  # ulysses_ring's Ulysses ranks per ring group
WEIGHTS = ("Parameter", "Buffer", "Gradient", "Optstate")  # MemTracker's categories that do not grow with T


def all_gather_route(model: torch.nn.Module, cp_mesh) -> None:
    """The route before the masked ring: each kernel given a mask first all-gathers every rank's K and V."""
    gather = _torch_compat.CP_ALL_GATHER_AUTOGRAD.get()

    def gather_keys_and_values(module, args):
        q, k, v, *mask = args
        if not mask or mask[0] is None:
            return None
        if isinstance(mask[0], RingMask):  # its dense (queries, all keys) rows, the keys in rank order as gathered
            mask = [torch.cat([mask[0].block(j) for j in range(mask[0].cp)], dim=-1), *mask[1:]]
        return (q, gather(k.contiguous(), 2, cp_mesh), gather(v.contiguous(), 2, cp_mesh), *mask)

    for module in model.modules():
        if isinstance(module, AttentionKernel):
            module.__dict__.pop("forward", None)  # the kernel's own forward back, not the ring's
            module.register_forward_pre_hook(gather_keys_and_values)


def step_tokens(seq_len: int, doc_len: int | None, bos_id: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of one sequence: random tokens, a BOS where each document starts."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (1, seq_len + 1), generator=gen)
    tokens[tokens == bos_id] = 0
    if doc_len is None:
        doc_ids = packed_doc_ids(1, seq_len + 1, gen)
        starts = torch.cat([torch.ones(1, 1, dtype=torch.bool), doc_ids[:, 1:] != doc_ids[:, :-1]], dim=1)
    else:
        starts = torch.rand(tokens.shape, generator=gen) < 1 / doc_len
        starts[0, 0] = True
    tokens[starts] = bos_id
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()


def peaks(tracker) -> dict[str, int]:
    """The whole step's peak and its activations (bytes), summed over the devices MemTracker saw."""
    peak: dict[str, int] = {}
    for by_category in tracker.get_tracker_snapshot("peak").values():
        for category, nbytes in by_category.items():
            name = getattr(category, "value", category)  # torch's categories are str enums
            peak[name] = peak.get(name, 0) + nbytes
    total = peak.get("Total", sum(peak.values()))
    return {"peak": total, "activations": total - sum(peak.get(name, 0) for name in WEIGHTS)}


def run_rank(rank: int, cp: int, method: str, mask: str, opts, port: int, folder: str) -> None:
    if cp > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        # a step at 16k-32k tokens on a few cores outlasts the default collective timeout
        dist.init_process_group("gloo", rank=rank, world_size=cp, timeout=datetime.timedelta(hours=4))
    torch.set_num_threads(max(1, opts.threads // cp))
    overrides = ["--training.local_batch_size", "1", "--training.global_batch_size", "1",
                 "--training.seq_len", str(opts.seq_len), "--training.mixed_precision_param", "float32",
                 "--activation_checkpoint.mode", "none", "--compile.enable", "false",
                 "--model.attn_mask_type", mask, "--parallelism.data_parallel_shard_degree", "1",
                 "--parallelism.context_parallel_degree", str(cp)]  # fmt: skip
    if cp > 1:
        overrides += ["--parallelism.context_parallel_method", "ring" if method == "allgather" else method]
    if cp > 1 and method == "ulysses_ring":
        overrides += ["--parallelism.context_parallel_ulysses_degree", str(ULYSSES_DEGREE)]
    cfg = load_config(opts.recipe, overrides)
    tokenizer = Tokenizer(cfg.model.tokenizer_path or DEFAULT_TOKENIZER_PATH)
    inputs, labels = step_tokens(opts.seq_len, opts.doc_len, tokenizer.bos_id, tokenizer.vocab_size)

    dims = ParallelDims.from_config(cfg.parallelism, cp)
    args = model_args_from_config(cfg.model, tokenizer.vocab_size, opts.seq_len)
    cpu = torch.device("cpu")
    parts = build_model_parts(cfg, dims, args, cpu).parts
    forward_backward = ForwardBackward(cfg, dims, parts, None, cpu, bos_id=tokenizer.bos_id)
    if cp > 1 and method == "allgather":
        all_gather_route(parts[0], dims.mesh["cp"])

    tracker = _torch_compat.MEM_TRACKER.get()()
    tracker.track_external(*parts)
    with tracker:  # the CP contexts cut the tokens they are given in place: each step gets its own copy
        forward_backward([(inputs.clone(), labels.clone())])
    result = peaks(tracker)
    cp_work = forward_backward.cp_work
    result["cp_imbalance"] = None if cp_work is None else imbalance(cp_work)

    cpu_seconds = thread_seconds = wall_seconds = 0.0
    for _ in range(opts.timed_steps):
        for part in parts:
            part.zero_grad(set_to_none=True)  # as the optimizer leaves them: the step allocates its gradients
        if cp > 1:
            dist.barrier()  # every rank starts the step together: wall time is the step's, not the stragglers'
        microbatch = [(inputs.clone(), labels.clone())]
        cpu_started, thread_started, wall_started = time.process_time(), time.thread_time(), time.perf_counter()
        forward_backward(microbatch)
        cpu_seconds += time.process_time() - cpu_started
        thread_seconds += time.thread_time() - thread_started
        wall_seconds += time.perf_counter() - wall_started
    n = opts.timed_steps
    # process_time: every thread of the rank (torch's intra-op threads, gloo's); thread_time: the Python thread's
    result.update(cpu_s=cpu_seconds / n, main_thread_cpu_s=thread_seconds / n, wall_s=wall_seconds / n)
    Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    if cp > 1:
        dist.destroy_process_group()
    # gloo jobs that built a DeviceMesh sometimes abort at interpreter exit after all their work (FACTS.md);
    # leaving at once keeps a finished row from failing the run
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(cp: int, method: str, mask: str, opts) -> dict[str, float]:
    """One row: its ranks' figures, as the largest rank's (memory, CPU, wall) and the sum over ranks (CPU)."""
    with tempfile.TemporaryDirectory(prefix="cp-steps-") as folder:
        mp.spawn(run_rank, args=(cp, method, mask, opts, free_port(), folder), nprocs=cp, join=True)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("rank*.json"))]
    row = {key: max(r[key] for r in ranks) for key in ("peak", "activations", "cpu_s", "main_thread_cpu_s", "wall_s")}
    row["cpu_sum_s"] = sum(r["cpu_s"] for r in ranks)
    row["cp_imbalance"] = ranks[0]["cp_imbalance"]
    return row


def rows_to_run(opts) -> list[tuple[str, int, str]]:
    """(mask, cp, method) of every row: CP 1 once a mask (one process, no method), then each CP degree by method."""
    rows = []
    for mask in opts.masks:
        for cp in opts.cps:
            for method in opts.methods if cp > 1 else ["-"]:
                if method == "allgather" and mask != "block_causal":
                    continue  # the ring needs no gathered keys without a mask
                if method == "ulysses_ring" and (cp <= ULYSSES_DEGREE or cp % ULYSSES_DEGREE):
                    continue
                rows.append((mask, cp, method))
    return rows


def print_table(results: dict[tuple[str, int, str], dict], opts) -> None:
    mib = 2**20
    mix = (f"documents starting with probability 1/{opts.doc_len}" if opts.doc_len else
           "documents log-normal, median 500 tokens, sigma 1.3")
    print(f"\nllama3 debug model, seq {opts.seq_len}, batch 1, fp32, no AC; block_causal: {mix}; {opts.threads} "
          f"threads split over the ranks. Per rank: MemTracker's peak of the first step, CPU (process_time) and "
          f"wall seconds of the second; max = the largest rank, sum = over the ranks; x cp1 = / CP 1 of the mask")
    print("| mask | cp | method | CPU s max | x cp1 | CPU s sum | x cp1 | activ. MiB | x cp1 | peak MiB | x cp1 "
          "| wall s | x cp1 | cp_imbalance |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    def cell(got, base, key, scale=1.0, fmt="{:.2f}"):
        ratio = "" if base is None else f"{got[key] / base[key]:.3f}"
        return f"{fmt.format(got[key] / scale)} | {ratio}"

    for (mask, cp, method), got in results.items():
        base = results.get((mask, 1, "-"))
        imb = "-" if got["cp_imbalance"] is None else f"{got['cp_imbalance']:.3f}"
        print(f"| {mask} | {cp} | {method} | {cell(got, base, 'cpu_s')} | {cell(got, base, 'cpu_sum_s')} | "
              f"{cell(got, base, 'activations', mib, '{:.1f}')} | {cell(got, base, 'peak', mib, '{:.1f}')} | "
              f"{cell(got, base, 'wall_s')} | {imb} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes/llama3_debug.toml"))
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--cps", default="1,2,4", help="context parallel degrees, comma-separated")
    parser.add_argument("--methods", default="ring,ulysses,ulysses_ring",
                        help=f"methods at CP > 1, comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--masks", default=",".join(MASKS), help="model.attn_mask_type values, comma-separated")
    parser.add_argument("--doc-len", type=int, default=None,
                        help="documents start at each position with probability 1 / this (default: the log-normal mix)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch threads, split over the ranks (default: this process's cores)")
    parser.add_argument("--timed-steps", type=int, default=1, help="untracked steps timed after the tracked one")
    opts = parser.parse_args()
    opts.cps = [int(c) for c in opts.cps.split(",")]
    opts.methods, opts.masks = opts.methods.split(","), opts.masks.split(",")
    for value, valid, what in ((opts.methods, METHODS, "method"), (opts.masks, MASKS, "mask")):
        if bad := [v for v in value if v not in valid]:
            parser.error(f"{what} {bad[0]!r} is none of {', '.join(valid)}")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the ranks inherit it: idle OpenMP threads sleep

    results = {}
    for mask, cp, method in rows_to_run(opts):
        results[mask, cp, method] = measure(cp, method, mask, opts)
        print(f"measured {mask} cp {cp} {method}: {results[mask, cp, method]}", flush=True)
    print_table(results, opts)


if __name__ == "__main__":
    main()

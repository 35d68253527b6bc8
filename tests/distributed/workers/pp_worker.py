"""Pipeline-parallel training vs one process, for each schedule named on the command line.

torchrun --standalone --nproc_per_node 2 tests/distributed/workers/pp_worker.py \
    --schedules GPipe,1F1B --out result.json [--cases cases.json]

Every rank first trains the whole model alone (same seed, same batches, AdamW, clipping) as
the reference, then trains each pipeline case over a 1-D pp mesh of all ranks. Rank 0 writes
per-step losses and gradient norms of both, and the largest weight difference after training.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from tests.fork_server import hand_over

if __name__ == "__main__":  # not when a test imports the module
    hand_over()  # run as a fork of the test session's server, when it has one

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titanctl.cli.console import finish
from titanctl.config.job_config import Parallelism
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.decoder import Transformer
from titanctl.parallel.layouts.pipeline_parallel import build_pipeline
from titanctl.parallel.layouts.weight_init import initialize_weights

SEED = 7
STEPS = 3
BATCH, SEQ = 4, 32
MAX_NORM = 0.5  # small enough that clipping acts, so the norm must span all stages
ARGS = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=SEQ)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)


def materialize(part: torch.nn.Module) -> None:
    part.to_empty(device="cpu")
    initialize_weights(part, SEED, buffer_device=torch.device("cpu"))
    part.train()


def reference() -> dict:
    with torch.device("meta"):
        model = Transformer(ARGS)
    materialize(model)
    opt = optimizer(model.parameters())
    losses, norms = [], []
    for inputs, labels in batches():
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=False)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        norms.append(norm.item())
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}


def clip_across_stages(params: list[torch.Tensor], max_norm: float, group) -> torch.Tensor:
    """Total 2-norm of all stages' gradients (each rank holds different ones), then clip."""
    grads = [p.grad for p in params if p.grad is not None]
    squared = torch.nn.utils.get_total_norm(grads, foreach=False) ** 2
    dist.all_reduce(squared, group=group)
    norm = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=False)
    return norm


def run_case(case: dict, mesh, ref: dict) -> dict:
    cfg = Parallelism(
        pipeline_parallel_degree=mesh.size(),
        pipeline_parallel_schedule=case.get("schedule", "1F1B"),
        pipeline_parallel_schedule_csv=case.get("schedule_csv", ""),
        pipeline_parallel_split_points=case.get("split_points", []),
        pipeline_parallel_layers_per_stage=case.get("layers_per_stage", 0),
        pipeline_parallel_microbatch_size=case.get("microbatch_size", 1),
    )
    group = mesh.get_group()
    with torch.device("meta"):
        model = Transformer(ARGS)
    start = time.perf_counter()
    accumulation = case.get("accumulation", 1)  # pipeline steps per optimizer step
    pipe = build_pipeline(
        model, mesh, cfg, device=torch.device("cpu"), local_batch_size=BATCH // accumulation,
        parallelize_fn=lambda stage: stage, loss_fn=loss_fn,
    )
    for part in pipe.model_parts:
        materialize(part)
    params = [p for part in pipe.model_parts for p in part.parameters()]
    opt = optimizer(params)
    losses, norms = [], []
    for inputs, labels in batches():
        loss = None
        for chunk_in, chunk_labels in zip(inputs.chunk(accumulation), labels.chunk(accumulation)):
            part = pipe.step(chunk_in, chunk_labels, loss_scale=1 / accumulation)
            if part is not None:
                loss = part / accumulation if loss is None else loss + part / accumulation
        norm = clip_across_stages(params, MAX_NORM, group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        # Only the last stage knows the loss: sum over ranks (zeros elsewhere) gives it to all.
        value = loss.detach().clone() if loss is not None else torch.zeros(())
        dist.all_reduce(value, group=group)
        losses.append(value.item())
        norms.append(norm.item())
    # Stage parameters keep their one-process names, so they compare one to one.
    diffs = {
        name: (p.detach() - ref["params"][name]).abs().max().item()
        for part in pipe.model_parts
        for name, p in part.named_parameters()
    }
    worst = max(diffs, key=diffs.get)
    stages = [s.stage_index for s in pipe.stages]
    layers = {s.stage_index: sorted(int(k) for k in s.submod.layers.keys()) for s in pipe.stages}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(
        gathered, {"stages": stages, "layers": layers, "params": len(diffs), "worst": (diffs[worst], worst)}
    )
    assert sum(g["params"] for g in gathered) == len(ref["params"]), "stages lost or duplicated parameters"
    diff, worst = max(g["worst"] for g in gathered)
    return {
        "pp_losses": losses,
        "pp_norms": norms,
        "ref_losses": ref["losses"],
        "ref_norms": ref["norms"],
        "max_param_diff": diff,
        "max_param_diff_name": worst,
        "n_microbatches": pipe.n_microbatches,
        "layout": [{k: g[k] for k in ("stages", "layers")} for g in gathered],
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedules", default="", help="comma-separated schedule names")
    parser.add_argument("--cases", default="", help="JSON file: {name: {schedule, schedule_csv, ...}}")
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))["pp"]
    cases = {name: {"schedule": name} for name in opts.schedules.split(",") if name}
    if opts.cases:
        with open(opts.cases) as f:
            cases.update(json.load(f))

    start = time.perf_counter()
    ref = reference()
    results = {"reference_seconds": time.perf_counter() - start, "cases": {}}
    for name, case in cases.items():
        results["cases"][name] = run_case(case, mesh, ref)
    if dist.get_rank() == 0:
        with open(opts.out, "w") as f:
            json.dump(results, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    dist.barrier()
    finish(0)  # destroy the process group, then os._exit (see titanctl.cli.console.finish: gloo aborts at exit otherwise)


if __name__ == "__main__":
    main()

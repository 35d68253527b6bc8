"""Context parallel vs one process: per-step losses of a tiny Llama under ring attention.

Launched by torchrun (gloo, CPU). Every rank first trains a reference copy on the whole
sequence locally (no communication), then, for each rotate method, trains a fresh copy with
the sequence sharded over a 1-D CP mesh of all ranks, all-reducing gradients over the CP
group. Rank 0 writes the loss curves (and the final weight differences) as JSON.

usage: torchrun --standalone --nproc_per_node N cp_worker.py allgather[,alltoall] OUT_JSON
"""

from __future__ import annotations

import json
import os
import sys
import time

from tests.fork_server import hand_over

if __name__ == "__main__":  # not when a test imports the module
    hand_over()  # run as a fork of the test session's server, when it has one

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental._context_parallel import _attention

from titanctl.cli.console import finish
from titanctl.models.common.args import ModelArgs, RopeScaling
from titanctl.models.common.decoder import Transformer
from titanctl.parallel.layouts.context_parallel import context_parallel_ctx
from titanctl.parallel.layouts.weight_init import initialize_weights

CPU_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
SEED, STEPS, BATCH, SEQ_LEN, LR = 0, 4, 2, 32, 3e-3
ARGS = ModelArgs(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,  # GQA: the model repeats k, v before SDPA
    vocab_size=128,
    multiple_of=32,
    max_seq_len=SEQ_LEN,  # the RoPE table is sharded like the tokens: it must be seq_len long
    rope_scaling=RopeScaling(original_max_position_embeddings=16),
)


def build() -> tuple[Transformer, torch.optim.Optimizer]:
    model = Transformer(ARGS)
    initialize_weights(model, SEED)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ_LEN + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # (B, T) each


def reference(inputs: torch.Tensor, labels: torch.Tensor) -> tuple[list[float], Transformer]:
    model, opt = build()
    losses = []
    for _ in range(STEPS):
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def context_parallel(
    mesh: DeviceMesh, inputs: torch.Tensor, labels: torch.Tensor, rotate_method: str
) -> tuple[list[float], list[list[float]], Transformer]:
    cp, group = mesh.size(), mesh.get_group()
    model, opt = build()
    losses, rank_losses = [], []
    for _ in range(STEPS):
        # Sharded in place and not restored: give CP its own copies of this step's batch.
        x, y = inputs.clone(), labels.clone()
        with context_parallel_ctx(
            mesh,
            buffers=[x, y, model.rope_cache],
            seq_dims=[1, 1, 0],
            no_restore={x, y},
            rotate_method=rotate_method,
        ):
            assert x.shape == (BATCH, SEQ_LEN // cp), x.shape
            loss = loss_fn(model(x), y)  # mean over this rank's B * T / cp tokens
            loss.backward()
        assert model.rope_cache.shape[0] == SEQ_LEN, "rope_cache was not restored"
        # The CPU ring-attention handlers are active only inside the CP context.
        assert CPU_SDPA not in DTensor._op_dispatcher._custom_op_handlers
        # Equal token counts per rank, so the global mean loss is the mean of the rank means
        # and its gradient is the mean of the rank gradients (gloo has no ReduceOp.AVG).
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(cp)
        gathered = [torch.zeros(()) for _ in range(cp)]
        dist.all_gather(gathered, loss.detach(), group=group)
        rank_losses.append([t.item() for t in gathered])
        losses.append(sum(rank_losses[-1]) / cp)
        opt.step()
        opt.zero_grad()
    return losses, rank_losses, model


def main() -> None:
    rotate_methods, out_path = sys.argv[1].split(","), sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    inputs, labels = data()

    t0 = time.perf_counter()
    ref, ref_model = reference(inputs, labels)
    result = {
        "world_size": dist.get_world_size(),
        "ref": ref,
        "ref_seconds": time.perf_counter() - t0,
        "runs": {},
    }
    ref_state = ref_model.state_dict()
    for rotate_method in rotate_methods:
        t0 = time.perf_counter()
        cp, rank_losses, cp_model = context_parallel(mesh, inputs, labels, rotate_method)
        cp_state = cp_model.state_dict()
        result["runs"][rotate_method] = {
            "cp": cp,
            "cp_rank_losses": rank_losses,
            "torch_rotate_option": _attention._cp_options.rotate_method.name,
            "max_weight_diff": max(
                (ref_state[k] - cp_state[k]).abs().max().item() for k in ref_state
            ),
            "cp_seconds": time.perf_counter() - t0,
        }
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    dist.barrier()
    finish(0)  # destroy the process group, then os._exit (see titanctl.cli.console.finish: gloo aborts at exit otherwise)


if __name__ == "__main__":
    main()

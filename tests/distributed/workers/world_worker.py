"""Train many cases in one torchrun world, one after another (tests/distributed/worlds.py).

    torchrun --nproc_per_node N world_worker.py PLAN.json

PLAN.json lists {"key", "args", "grads", "command", "folder"}. Each case is a Trainer of its own on the same
process group, exactly as ``titanctl train ARGS --job.dump_folder FOLDER`` would build it (command rl: an
RLTrainer, as ``titanctl rl`` builds it), plus
init_digests_rank{r}.json (a digest of every parameter gathered whole before the first step; in a world
of one process, where the references run, also the tensors themselves: init_rank0.pt) and, with "grads", the first
step's gradients before clipping (grads_rank{r}.pt) and the experts' meshes (experts_rank{r}.json) (command rl:
also the first rollout, rollout_rank{r}.pt: tokens, prompt and response lengths, the sampler's logprobs);
with "final", every parameter gathered whole after the last step (final_rank{r}.pt) and, under Muon, the
Newton-Schulz FLOPs the rank ran (ns_flops_rank{r}.json);
with "probe", what sync_train_worker.py records.
What the case prints goes to FOLDER/stdout_rank{r}.txt and stderr_rank{r}.txt. Rank 0 writes FOLDER/done (the case's seconds) once every rank finished the case. A case that raises writes
error_rank{r}.txt and ends the world: its peers may be waiting in a collective it never joins.
"""

import contextlib
import gc
import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

from tests.fork_server import hand_over

if __name__ == "__main__":  # not when a test imports the module
    hand_over()  # run as a fork of the test session's server, when it has one

from titanctl.gc_pauses import heavy_imports

with heavy_imports():
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tests.distributed.workers.sync_train_worker import train_probed
    from titanctl.cli.console import finish
    from titanctl.config.recipe import load_config
    from titanctl.parallel.layouts.weight_init import canonical_name
    from titanctl.rl.loop import RLTrainer
    from titanctl.rl.update import PolicyUpdate
    from titanctl.train.step import ForwardBackward
    from titanctl.train.trainer import Trainer

GRADS_TO: list[Path | None] = [None]  # the running case's folder when it dumps its first gradients


def full(tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()).float().cpu().clone()


def digests(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """{name: dtype, shape and SHA-256 of the bytes}: equal digests are equal tensors, bit for bit."""
    return {name: f"{t.dtype} {tuple(t.shape)} {hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()}"
            for name, t in weights.items()}


def dump_first_step_gradients() -> None:
    """Every ForwardBackward (and RL PolicyUpdate) writes its first call's gradients (a tied table once, with
    both uses' sum)."""
    for cls, parts in ((ForwardBackward, lambda step: step.model_parts), (PolicyUpdate, lambda step: [step.model])):
        _dump_after(cls, parts)


def _dump_after(cls, parts_of) -> None:
    step_call = cls.__call__

    def call(self, *args):
        loss = step_call(self, *args)
        folder = GRADS_TO[0]
        if folder is not None and not getattr(self, "gradients_dumped", False):
            self.gradients_dumped = True
            rank = os.environ.get("RANK", "0")
            model_parts = parts_of(self)
            grads = {canonical_name(name): full(param.grad)  # a frozen weight (LoRA's base) has none
                     for part in model_parts for name, param in part.named_parameters() if param.grad is not None}
            torch.save(grads, folder / f"grads_rank{rank}.pt")
            experts = {canonical_name(name): dict(zip(param.device_mesh.mesh_dim_names, param.device_mesh.shape))
                       for part in model_parts for name, param in part.named_parameters()
                       if name.endswith(("experts.w1", "experts.w13", "experts.gate_up_proj"))
                       and isinstance(param, DTensor)}
            (folder / f"experts_rank{rank}.json").write_text(json.dumps(experts))
            if isinstance(self, PolicyUpdate):  # the first rollout as this rank sampled it
                batch = args[0]
                torch.save({"tokens": batch.tokens.cpu(), "prompt_lengths": batch.prompt_lengths.cpu(),
                            "response_lengths": batch.response_lengths.cpu(),
                            "sampler_logprobs": batch.sampler_logprobs.cpu()}, folder / f"rollout_rank{rank}.pt")
        return loss

    cls.__call__ = call


def run_case(case: dict) -> None:
    folder = Path(case["folder"])
    cfg = load_config(None, [*case["args"], "--job.dump_folder", str(folder)])
    GRADS_TO[0] = folder if case["grads"] else None
    trainer = RLTrainer(cfg) if case.get("command") == "rl" else Trainer(cfg)
    weights = {canonical_name(name): full(param) for part in trainer.model_parts for name, param in part.named_parameters()}
    rank = trainer.env.rank
    # Digests: the layouts' initial weights must equal one process's bit for bit, and 110 cases' whole
    # tensors would be gigabytes written and read back.
    (folder / f"init_digests_rank{rank}.json").write_text(json.dumps(digests(weights)))
    if trainer.env.world_size == 1:
        torch.save(weights, folder / f"init_rank{rank}.pt")
    if case["probe"]:
        train_probed(trainer)
    else:
        trainer.train()
    if case.get("final"):
        weights = {canonical_name(name): full(param) for part in trainer.model_parts
                   for name, param in part.named_parameters()}
        torch.save(weights, folder / f"final_rank{trainer.env.rank}.pt")
        if hasattr(trainer.optimizer, "ns_flops"):  # Muon: the Newton-Schulz FLOPs this rank ran
            (folder / f"ns_flops_rank{trainer.env.rank}.json").write_text(json.dumps(trainer.optimizer.ns_flops))


@contextlib.contextmanager
def output_to(folder: Path, rank: int):
    """The process's stdout and stderr (file descriptors, so C++ and rich's console too) into the case's files."""
    folder.mkdir(parents=True, exist_ok=True)
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, name in ((1, "stdout"), (2, "stderr")):
        with open(folder / f"{name}_rank{rank}.txt", "wb") as f:
            os.dup2(f.fileno(), fd)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ.get("RANK", "0"))
    dump_first_step_gradients()
    for case in plan:
        print(f"[world] case {case['key']}", flush=True)
        start = time.perf_counter()
        try:
            with output_to(Path(case["folder"]), rank):
                run_case(case)
        except BaseException:
            Path(case["folder"]).mkdir(parents=True, exist_ok=True)
            Path(case["folder"], f"error_rank{rank}.txt").write_text(traceback.format_exc())
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        if dist.is_initialized():
            dist.barrier()
        if rank == 0:
            Path(case["folder"], "done").write_text(f"{time.perf_counter() - start:.2f}")
        torch._dynamo.reset()  # a later case's compiled blocks are compiled for it, not guarded out
        gc.collect()


if __name__ == "__main__":
    main()
    finish(0)  # destroy the process group, then os._exit (gloo aborts at exit otherwise)

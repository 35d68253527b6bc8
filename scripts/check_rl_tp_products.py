"""Check titanctl rl's tensor-parallel products against one process and against TP 2 alone (a manual check,
not part of `make test`, whose 4-process world runs no rl case: its cost is past the suite's budget).

From the repository root (about 2 minutes on 2 cores):

    PYTHONPATH=. .venv/bin/python scripts/check_rl_tp_products.py [FOLDER]

It runs tests/distributed/workers/world_worker.py, as the suite's worlds do, for the cases of
tests/distributed/test_rl_layouts.py (rl.batch_invariant on, 4 prompts x 4 completions, 3 steps): one process,
TP 2, TP 2 x FSDP 2, and for qwen3_moe with routing replay TP 2 and TP 2 x EP 2 (x FSDP 2); then prints, for
each layout, the relative loss and first-step gradient differences to one process, whether the rewards are
bitwise equal, every step's logprob_diff_max, and whether the first rollout's sampler logprobs (the data-parallel
ranks' shares, concatenated) equal TP 2's bit for bit. It exits non-zero if any of these fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RUN = ["--model.n_layers", "2", "--training.seq_len", "48", "--training.steps", "3",
       "--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
       "--activation_checkpoint.mode", "none", "--optimizer.lr", "1e-3", "--rl.prompts_per_step", "4",
       "--rl.group_size", "4", "--rl.max_response_tokens", "4", "--rl.rewards", "tests.rl_rewards:chars",
       "--rl.batch_invariant", "true"]
MOE = ["--model.name", "qwen3_moe", "--rl.routing_replay", "true"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
ALONE = ["--parallelism.data_parallel_shard_degree", "1"]
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
WORLDS = {  # processes -> {case: args}
    1: {"single": [*RUN, "--training.local_batch_size", "16"],
        "single_moe": [*RUN, *MOE, "--training.local_batch_size", "16"]},
    2: {"tp2": [*RUN, "--training.local_batch_size", "8", *TP2, *ALONE],
        "moe_tp2": [*RUN, *MOE, "--training.local_batch_size", "16", *TP2, *ALONE]},
    4: {"tp2_fsdp2": [*RUN, "--training.local_batch_size", "8", *TP2, *FSDP2],
        "moe_tp2_ep2": [*RUN, *MOE, "--training.local_batch_size", "8", *TP2, *FSDP2,
                        "--parallelism.expert_parallel_degree", "2"]},
}
# layout, its reference, its TP 2 twin, processes, the ranks holding each data-parallel share (tp rank 0)
CHECKS = [("tp2", "single", "tp2", 2, [0]), ("tp2_fsdp2", "single", "tp2", 4, [0, 2]),
          ("moe_tp2", "single_moe", "moe_tp2", 2, [0]), ("moe_tp2_ep2", "single_moe", "moe_tp2", 4, [0, 2])]


def run_world(root: Path, nproc: int) -> None:
    plan = [{"key": key, "args": args, "grads": True, "probe": False, "final": False, "command": "rl",
             "folder": str(root / key)} for key, args in WORLDS[nproc].items()]
    (root / f"world{nproc}.json").write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    with open(root / f"world{nproc}.log", "w") as log:
        code = subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                f"--nproc_per_node={nproc}", str(REPO / "tests/distributed/workers/world_worker.py"),
                                str(root / f"world{nproc}.json")], stdout=log, stderr=subprocess.STDOUT, env=env,
                               cwd=REPO)
    if code:
        raise SystemExit(f"the world of {nproc} failed (exit {code}): see {root / f'world{nproc}.log'}")


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def grads(folder: Path, nproc: int) -> dict[str, torch.Tensor]:
    merged = {}
    for rank in range(nproc):
        merged.update(torch.load(folder / f"grads_rank{rank}.pt"))
    return merged


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="rl-tp-"))
    root.mkdir(parents=True, exist_ok=True)
    for nproc in WORLDS:
        run_world(root, nproc)
    failed = False
    for layout, reference, twin, nproc, shares in CHECKS:
        want, got = rows(root / reference), rows(root / layout)
        scale = max(1e-2, *(abs(r["loss"]) for r in want))
        loss_diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(got, want)) / scale
        ref_grads, layout_grads = grads(root / reference, 1), grads(root / layout, nproc)
        grad_diff = max(((layout_grads[n] - g).abs().max() / g.abs().max()).item() for n, g in ref_grads.items())
        rewards = [r["reward_mean"] for r in got] == [r["reward_mean"] for r in want]
        diffs = [r["logprob_diff_max"] for r in got]
        sampled = torch.cat([torch.load(root / layout / f"rollout_rank{r}.pt")["sampler_logprobs"] for r in shares])
        bitwise = torch.equal(sampled, torch.load(root / twin / "rollout_rank0.pt")["sampler_logprobs"])
        print(f"{layout:12s} procs {nproc}  rel loss diff {loss_diff:.1e}  grad diff {grad_diff:.1e}  rewards equal "
              f"{rewards}  logprob_diff_max {diffs}  sampler logprobs == {twin}'s bitwise: {bitwise}")
        failed |= not (loss_diff <= 1e-5 and grad_diff <= 1e-5 and rewards and bitwise and not any(diffs))
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()

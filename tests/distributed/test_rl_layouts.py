"""titanctl rl under every layout it runs gives one process's losses and first-step gradients: the loss
divides by the global count of what it averages (completions, or response tokens), over microbatches and
data-parallel ranks. With rl.batch_invariant every layout also samples one process's completions bit for
bit (each rank samples its share of the prompts; no row depends on the others), so the rewards match
exactly; under tensor parallelism (TP 2, where each row-parallel sum of two partials is exact) a prompt's
sampler logprobs are the same whatever the batch around it. The cases run in the torchrun worlds of tests/distributed/worlds.py."""

from __future__ import annotations

import json

import pytest

from tests.distributed.harness import gathered, max_rel_diff, rows
from tests.distributed.worlds import register

RUN = ["--model.n_layers", "2", "--training.seq_len", "48", "--training.steps", "3",
       "--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
       "--activation_checkpoint.mode", "none", "--optimizer.lr", "1e-3", "--rl.prompts_per_step", "4",
       "--rl.group_size", "4", "--rl.max_response_tokens", "4", "--rl.rewards", "tests.rl_rewards:chars",
       "--rl.batch_invariant", "true"]
MOE = ["--model.name", "qwen3_moe", "--rl.routing_replay", "true"]
# DAPO: token-level loss over ranks, the rollout-wide std, dynamic sampling, clip-higher; three updates on one
# rollout, so that the ratio leaves 1 and clips.
DAPO = ["--rl.loss_type", "dapo", "--rl.scale_rewards", "batch", "--rl.dynamic_sampling", "true",
        "--rl.epsilon_high", "0.28", "--rl.updates_per_rollout", "3", "--optimizer.lr", "3e-3"]
GSPO = ["--rl.importance_sampling_level", "sequence", "--rl.kl_coef", "0.1", "--rl.updates_per_rollout", "3",
        "--rl.epsilon", "3e-4", "--rl.epsilon_high", "4e-4"]
FLAVORS = {"grpo": [], "dapo": DAPO, "gspo": GSPO, "moe": MOE}
REFERENCES = {name: register(__name__, f"single_{name}", 1, [*RUN, *flavor, "--training.local_batch_size", "16"],
                             grads=True, always=True, command="rl")
              for name, flavor in FLAVORS.items()}
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
TP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
LAYOUTS = [  # (id, reference, processes, local batch, overrides); 16 completions a rollout everywhere
    ("accumulation", "grpo", 1, 3, []),
    ("fsdp2", "grpo", 2, 8, FSDP2),
    ("ddp2", "grpo", 2, 3, ["--parallelism.data_parallel_replicate_degree", "2",
                            "--parallelism.data_parallel_shard_degree", "1"]),
    ("dapo_fsdp2", "dapo", 2, 3, FSDP2),
    ("gspo_fsdp2", "gspo", 2, 8, FSDP2),
    ("moe_ep2", "moe", 2, 8, [*FSDP2, "--parallelism.expert_parallel_degree", "2"]),
    ("tp2", "grpo", 2, 8, TP2),
    ("tp2_fsdp2", "grpo", 4, 8, [*TP2[:2], *FSDP2]),
    ("moe_tp2_ep2", "moe", 4, 8, [*TP2[:2], *FSDP2, "--parallelism.expert_parallel_degree", "2"]),
]
CASES = [register(__name__, name, nproc, [*RUN, *FLAVORS[ref], "--training.local_batch_size", str(local), *overrides],
                  grads=True, command="rl")
         for name, ref, nproc, local, overrides in LAYOUTS]
# TP 2 sampling half of tp2's batch: its first rollout is tp2's first two prompts (the same places in the
# same step, so the same noise), decoded among 8 rows instead of 16.
TP2_HALF = register(__name__, "tp2_half_batch", 2, [*RUN, "--training.local_batch_size", "8", *TP2,
                                                    "--rl.prompts_per_step", "2", "--training.steps", "1"],
                    grads=True, command="rl")


@pytest.mark.parametrize("world_case, ref, nproc", [(case, ref, nproc) for case, (_, ref, nproc, _, _) in
                                                    zip(CASES, LAYOUTS)], ids=[layout[0] for layout in LAYOUTS])
def test_rl_layout_matches_single_process(worlds, world_case, ref, nproc):
    reference = worlds.folder(REFERENCES[ref])
    want, got = rows(reference), rows(worlds.folder(world_case))
    ref_grads, grads = gathered(reference, 1, "grads"), gathered(worlds.folder(world_case), nproc, "grads")
    assert grads.keys() == ref_grads.keys()
    grad_diff = max(((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in ref_grads.items())
    # GRPO's on-policy loss is -mean(A) = 0 up to the rounding of terms of size |A| / length (~1e-8 here): losses
    # are compared against the largest one or 1e-2. The policy's entropy on each rollout follows the weights
    # every earlier update left.
    scale = max(1e-2, *(abs(r["loss"]) for r in want))
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(got, want)) / scale
    entropy_diff = max_rel_diff([r["entropy"] for r in got], [r["entropy"] for r in want])
    print(f"\nRL LAYOUT {world_case.split('::')[1]:14s} procs {nproc}  max rel loss diff {diff:.2e}  "
          f"entropy diff {entropy_diff:.1e}  grad diff {grad_diff:.1e}")
    # The same completions (batch-invariant sampling) and so the same rewards, bit for bit, and no mismatch.
    assert [r["reward_mean"] for r in got] == [r["reward_mean"] for r in want]
    assert all(r["logprob_diff_max"] == 0.0 for r in got)
    assert len(got) == 3
    assert diff <= 1e-5, f"max relative loss difference {diff:.2e}\n{json.dumps(got)}\n{json.dumps(want)}"
    assert entropy_diff <= 1e-5, f"entropies off by {entropy_diff:.2e}"
    assert grad_diff <= 1e-5, f"first-step gradient off by {grad_diff:.2e} of its largest"


def test_the_references_train_what_their_keys_say(worlds):
    """Each reference exercises its keys: DAPO and GSPO clip on their later updates, GSPO keeps a KL."""
    data = {name: rows(worlds.folder(key)) for name, key in REFERENCES.items()}
    assert all(r["clip_fraction"] == 0 for r in data["grpo"])  # one update per rollout: on-policy
    assert any(r["clip_fraction"] > 0 for r in data["dapo"][1:]) and any(r["clip_fraction"] > 0 for r in data["gspo"][1:])
    assert data["gspo"][0]["kl"] == 0 and data["gspo"][-1]["kl"] > 0 and data["grpo"][0]["kl"] is None


def test_tensor_parallel_sampling_is_batch_invariant(worlds):
    """Under one TP degree a prompt's completions and the sampler's logprobs of them are the same bit for bit
    whatever shares its batch and whatever the layout around TP: tp2's first 8 rows against the same prompts
    sampled alone (tp2_half_batch) and against TP 2 x FSDP 2's first data-parallel share (its tp rank 0)."""
    import torch

    def case(name):
        return CASES[[layout[0] for layout in LAYOUTS].index(name)]

    whole = torch.load(worlds.folder(case("tp2")) / "rollout_rank0.pt")
    half = torch.load(worlds.folder(TP2_HALF) / "rollout_rank0.pt")
    product = torch.load(worlds.folder(case("tp2_fsdp2")) / "rollout_rank0.pt")
    assert all(r["logprob_diff_max"] == 0.0 for r in rows(worlds.folder(TP2_HALF)))
    for other in (half, product):
        for key in ("prompt_lengths", "response_lengths", "sampler_logprobs"):
            assert torch.equal(other[key], whole[key][:8]), key
        ends = other["prompt_lengths"] + other["response_lengths"]
        for row, end in enumerate(ends.tolist()):  # the batch's width is its longest prompt's
            assert other["tokens"][row, :end].tolist() == whole["tokens"][row, :end].tolist(), f"row {row}"
    assert half["sampler_logprobs"].abs().sum() > 0

"""Muon (optimizer.name = "Muon") under FSDP 2, TP 2, FSDP 2 x TP 2 (strided shards), EP 2 (each expert its own
matrix, optimizer.muon_experts) and PP 2 reproduces one process: per-step losses within 1e-5 relative and every
parameter after 5 steps within 1e-5 of its largest value (fp32). Newton-Schulz needs whole matrices, so a wrong
gather or a shard cut from the wrong place shows in the parameters at once. Each matrix is orthogonalized on one
rank of its mesh only: the ranks' Newton-Schulz FLOPs add up to one process's.

The cases run in the shared torchrun worlds (tests/distributed/worlds.py); each reference runs only with a test
that compares with it (its ``reference_case``)."""

from __future__ import annotations

import json

import pytest

from tests.distributed.harness import TINY_RUN, gathered, losses, max_rel_diff, worst_tensor_diff
from tests.distributed.worlds import register

MUON = ["--optimizer.name", "Muon", "--optimizer.muon_experts", "--training.steps", "5"]
QWEN3 = ["--model.name", "qwen3", "--model.flavor", "debugmodel_untied"]
QWEN3_MOE = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
PARAM_TOL = 1e-5  # of the tensor's largest value

REFERENCES = {name: register(__name__, f"single_{name}", 1, [*TINY_RUN, *MUON, *flavor, "--training.local_batch_size",
                                                              "8"], final=True)
              for name, flavor in (("dense", QWEN3), ("moe", QWEN3_MOE))}

# (id, reference, processes, local batch, overrides); global batch is 8 sequences everywhere.
LAYOUTS = [
    ("fsdp2", "dense", 2, 4, []),
    ("tp2", "dense", 2, 8, TP2),
    ("fsdp2_tp2", "dense", 4, 4, TP2),
    ("pp2", "dense", 2, 8, PP2),
    ("moe_ep2", "moe", 2, 4, ["--parallelism.expert_parallel_degree", "2"]),
]
CASES = [register(__name__, name, nproc, [*TINY_RUN, *MUON, *(QWEN3 if ref == "dense" else QWEN3_MOE),
                                         "--training.local_batch_size", str(local_batch), *overrides], final=True)
         for name, ref, nproc, local_batch, overrides in LAYOUTS]


@pytest.mark.parametrize("world_case, reference_case, nproc",
                         [(case, REFERENCES[ref], nproc) for case, (_, ref, nproc, _, _) in zip(CASES, LAYOUTS)],
                         ids=[layout[0] for layout in LAYOUTS])
def test_muon_layout_matches_single_process(worlds, world_case, reference_case, nproc):
    ref = worlds.folder(reference_case)
    folder = worlds.folder(world_case)
    ref_params, params = gathered(ref, 1, "final"), gathered(folder, nproc, "final")
    assert params.keys() == ref_params.keys()
    param_diff, worst = worst_tensor_diff(params, ref_params)
    got, ref_losses = losses(folder), losses(ref)
    loss_diff = max_rel_diff(got, ref_losses)
    print(f"\nMUON LAYOUT {world_case.split('::')[1]:10s} procs {nproc}  max rel loss diff {loss_diff:.2e}  "
          f"param diff {param_diff:.1e} ({worst})")
    assert len(got) == 5 and got[-1] != got[0]
    assert loss_diff <= 1e-5, (got, ref_losses)
    assert param_diff <= PARAM_TOL, f"{worst} off by {param_diff:.2e} of its largest value after 5 steps"
    # Each matrix is orthogonalized once in the world: the ranks' Newton-Schulz FLOPs add up to one process's.
    flops = [json.loads((folder / f"ns_flops_rank{r}.json").read_text()) for r in range(nproc)]
    one = json.loads((ref / "ns_flops_rank0.json").read_text())
    print(f"MUON LAYOUT {world_case.split('::')[1]:10s} Newton-Schulz GFLOP per rank "
          f"{[round(f / 1e9, 3) for f in flops]} (one process {one / 1e9:.3f})")
    assert sum(flops) == one and max(flops) < one, flops

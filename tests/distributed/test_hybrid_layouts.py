"""Qwen3.5 (dense and MoE: three Gated DeltaNet layers, then gated full attention) under every parallel
layout reproduces the single-process run, as test_family_layouts.py checks the other families: the same
initial weights bit for bit, the first step's gradient of every parameter (the MoE's routers, its shared
expert's gate, each Gated DeltaNet's a_log, dt_bias, conv and gated norm included), per-step losses within
1e-5 relative (fp32) and each step's tokens per expert.

Context parallel is the case no other family has: the Gated DeltaNet layers carry their recurrent state and
their conv's last inputs from rank to rank (a prefix scan over the ranks' chunk maps,
titanctl/parallel/layouts/linear_attention_cp.py) while the full-attention layers run torch's ring (causal)
or the masked ring (block_causal: masked_ring.py); CP 2 and CP 4, both masks, documents crossing the ranks' chunks.
Under Ulysses (``ulysses_cp2_documents``) the Gated DeltaNet layers trade positions for heads instead; under
``ulysses_ring`` (``ring2_ulysses2``, causal and documents) they trade them within each pair of neighbouring ranks,
then scan across the pairs.
Tensor parallel splits the Gated DeltaNet layers by key-head groups (titanctl/models/qwen3_5/blocks.py);
Qwen3-Next's fused projections too (``next_tp2``).

The cases run in the shared torchrun worlds (tests/distributed/worlds.py); each reference runs only with a
test that compares with it (its ``reference_case``).
"""

from __future__ import annotations

import pytest

from tests.distributed.harness import (
    TINY_RUN,
    assert_same_init,
    expert_loads,
    gathered,
    init_digests,
    losses,
    max_rel_diff,
    worst_tensor_diff,
)
from tests.distributed.test_family_layouts import DOCUMENTS, write_documents
from tests.distributed.worlds import register

DENSE = ["--model.name", "qwen3_5", "--model.flavor", "debugmodel"]
DENSE_UNTIED = ["--model.name", "qwen3_5", "--model.flavor", "debugmodel_untied"]
MOE = ["--model.name", "qwen3_5_moe", "--model.flavor", "debugmodel",
       "--moe.load_balance_coeff", "0.01", "--moe.router_aux_loss_coef", "0.01"]
# Qwen3-Next: the MoE's blocks with the fused Gated DeltaNet projections (wqkvz, wba), split by key-head groups.
NEXT = ["--model.name", "qwen3_next", "--model.flavor", "debugmodel",
        "--moe.load_balance_coeff", "0.01", "--moe.router_aux_loss_coef", "0.01"]
FLAVORS = {"dense": DENSE, "untied": DENSE_UNTIED, "moe": MOE, "dense_documents": [*DENSE, *DOCUMENTS], "next": NEXT}
MOE_LAYERS = 4  # every block of the MoE debug model routes
# Of each tensor's largest first-step gradient. Under CP the delta rule's state sums run in another order
# (chunk maps composed across ranks): the smallest gradients, dt_bias and a_log (largest |g| 1.9e-4, their
# token sums cancelling), move by ~2e-8 absolute, 1.1e-4 to 1.4e-4 of their largest, as much as wa's
# (6.7e-3) move absolutely. tests/unit/parallel/test_linear_attention_cp.py shows the scan exact in fp64.
# Under TP (out_proj's partial sums, the sequence's reduce-scatter) the same two move by 1e-8 to 2e-8
# absolute in the last Gated DeltaNet layer, 1.0e-4 to 1.1e-4 of their largest (1e-4 to 2e-4); every other
# tensor by at most 4e-6 of its largest.
GRAD_TOL, RESUMMED_GRAD_TOL = 1e-4, 5e-4

REFERENCES = {name: register(__name__, f"single_{name}", 1, [*TINY_RUN, *flavor, "--training.local_batch_size", "8"],
                             grads=True, prepare=write_documents if "documents" in name else None)
              for name, flavor in FLAVORS.items()}

TP2 = ["--parallelism.tensor_parallel_degree", "2"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
CP4 = ["--parallelism.context_parallel_degree", "4"]
HSDP = ["--parallelism.data_parallel_replicate_degree", "2"]
ULYSSES_RING2 = ["--parallelism.context_parallel_method", "ulysses_ring", "--parallelism.context_parallel_ulysses_degree",
                 "2"]

# CP and TP cases train 2 steps (the first step's gradients and the loss after one update carry their checks):
# they are compared with the first 2 of their reference's 3 losses.
TWO_STEPS = ["--training.steps", "2"]

# (id, reference, processes, local batch, overrides); global batch is 8 sequences everywhere. The MoE model holds
# every block the dense one has but its FFN, so its EP 2 x HSDP 2 x 2 case is HSDP's 4-process case for both.
LAYOUTS = [
    ("fsdp2", "dense", 2, 4, []),
    ("pp2", "untied", 2, 8, PP2),
    ("moe_ep2_hsdp2x2", "moe", 4, 2, [*EP2, *HSDP]),
    ("moe_pp2", "moe", 2, 8, PP2),
    # The Gated DeltaNet layers' state and conv halo cross the ranks' chunks (chunks of 16 and 8 tokens). CP 2:
    # moe_ep2_cp2 (causal) and tp2_cp2_documents; EP 2 alone is in moe_ep2_hsdp2x2 and moe_ep2_cp2.
    ("cp4", "dense", 4, 8, [*CP4, *TWO_STEPS]),
    ("cp4_documents", "dense_documents", 4, 8, [*CP4, *TWO_STEPS]),
    ("moe_ep2_cp2", "moe", 2, 8, [*EP2, *CP2, *TWO_STEPS]),
    # Each rank holds one key-head group of every Gated DeltaNet layer (its q, k, 2 value heads, their conv
    # channels, dt_bias and a_log) and half the full-attention heads; the gated norm's weight is whole.
    ("tp2", "dense", 2, 8, [*TP2, *TWO_STEPS]),
    ("moe_tp2", "moe", 2, 8, [*TP2, *TWO_STEPS]),
    # Qwen3-Next: each rank holds whole key-head groups of wqkvz (q, k, v and z) and wba (b and a).
    ("next_tp2", "next", 2, 8, [*TP2, *TWO_STEPS]),
    # TP x CP: the scan runs on each rank's heads (local to it), documents crossing the chunks.
    ("tp2_cp2_documents", "dense_documents", 4, 8, [*TP2, *CP2, *TWO_STEPS]),
    # Ulysses: each rank runs every position of one key-head group of every Gated DeltaNet layer (and half the
    # full-attention heads) under the one-process document mask (linear_attention_ulysses.py).
    ("ulysses_cp2_documents", "dense_documents", 2, 8, [*CP2, "--parallelism.context_parallel_method", "ulysses",
                                                        *TWO_STEPS]),
    # ulysses_ring, CP 4 = ring 2 x Ulysses 2: each pair of neighbours all-to-alls one key-head group of every Gated
    # DeltaNet layer (and half the full-attention heads), the two pairs pass the scan's state and halo (chunks of
    # 16 tokens, head-tail over the pairs) and run the masked ring; causal and documents.
    ("ring2_ulysses2", "dense", 4, 8, [*CP4, *ULYSSES_RING2, *TWO_STEPS]),
    ("ring2_ulysses2_documents", "dense_documents", 4, 8, [*CP4, *ULYSSES_RING2, *TWO_STEPS]),
]

CASES = [register(__name__, name, nproc, [*TINY_RUN, *FLAVORS[ref], "--training.local_batch_size", str(local_batch),
                                         *overrides], grads=True,
                  prepare=write_documents if "documents" in ref else None)
         for name, ref, nproc, local_batch, overrides in LAYOUTS]


@pytest.mark.parametrize("world_case, reference_case, ref, nproc, overrides",
                         [(case, REFERENCES[ref], ref, nproc, overrides)
                          for case, (_, ref, nproc, _, overrides) in zip(CASES, LAYOUTS)],
                         ids=[layout[0] for layout in LAYOUTS])
def test_hybrid_layout_matches_single_process(worlds, world_case, reference_case, ref, nproc, overrides):
    reference = worlds.folder(reference_case)
    folder = worlds.folder(world_case)
    name = world_case.split("::")[1]
    assert_same_init(folder, nproc, init_digests(reference, 1))
    grads = gathered(folder, nproc, "grads")
    grad_diff, worst = worst_tensor_diff(grads, gathered(reference, 1, "grads"))
    cp = "context_parallel_degree" in " ".join(overrides)
    got, ref_losses = losses(folder), losses(reference)
    assert len(got) == (2 if TWO_STEPS[0] in overrides else 3) and len(ref_losses) == 3
    diff = max_rel_diff(got, ref_losses[:len(got)])
    print(f"\nHYBRID LAYOUT {name:24s} procs {nproc}  max rel loss diff {diff:.2e}  grad diff {grad_diff:.1e} ({worst})")
    assert got[-1] != got[0]
    assert any(".attention.a_log" in key for key in grads)  # the Gated DeltaNet layers' gradients are compared
    tol = RESUMMED_GRAD_TOL if cp or "tensor_parallel_degree" in " ".join(overrides) else GRAD_TOL
    assert grad_diff <= tol, f"{name}: first-step gradient of {worst} off by {grad_diff:.2e} of its largest"
    assert diff <= 1e-5, f"{name}: max relative loss difference {diff:.2e}\n{got}\n{ref_losses}"
    loads = expert_loads(reference)[:len(got)]
    assert expert_loads(folder) == loads, f"{name}: tokens per expert differ from one process"
    if ref.startswith("moe") or ref == "next":
        assert all(load and len(load) == MOE_LAYERS for load in loads)  # every MoE layer, every step

"""DeepSeek-V4's debug model (heavily compressed, compressed sparse with its indexer, sliding-window layers;
4 hyper-connection streams; the first MoE layer hash-routed) under FSDP 2 x EP 2, PP 2, TP 2 and CP 2 reproduces the
single-process run, as test_family_layouts.py checks the other families: the same initial weights bit for
bit, the first step's gradient of every parameter (hyper-connections, compressors, sinks, routers, both
kinds of experts), per-step losses within 1e-5 relative (fp32).

Sequences of 128 tokens: a CSA layer has 32 compressed entries of which the indexer keeps 16, so its top-k
selects (at 64 it would keep every entry). The indexer trains by its own KL loss (model.indexer_loss_coeff,
titanctl/models/deepseek_v4/indexer_loss.py), on in every run: its gradients are compared too.

TP 2 (tensor_parallel_degree 2, with sequence and loss parallel): query heads, sinks and the grouped output
projection split (titanctl/models/deepseek_v4/tp_plan.py), the shared KV head, compressors, indexer, mHC and
the MoE layers whole on every rank. The indexer must choose the same entries on both ranks: its top-k decides
which entries its sparse loss spans, so its gradients, bitwise equal on both ranks, say it did.

FSDP 2 x EP 2 on 2 processes: the dense weights sharded over both ranks, each MoE layer's routed experts
split 4 + 4 over them with tokens exchanged by all-to-all, the hash-routed layer's too. PP 2: blocks 0-1 and
2-3, the boundary carrying the streams and the token ids (titanctl/models/deepseek_v4/model.py). CP 2: each
rank holds head-tail chunks 0 and 3 or 1 and 2 of 32 tokens; the window's (32) preceding rows, the CSA
compressor's previous window and every chunk's compressed entries cross the ranks
(titanctl/parallel/layouts/sequence_pieces.py), the indexer's top-k over the gathered entries.

On 4 processes: FSDP 2 x EP 2 x TP 2; TP 2 x CP 2 (each CP rank's chunks sequence-parallel over its TP pair,
the attention running its TP rank's heads over its CP rank's pieces); HSDP (replicate 2 x shard 2).

The cases run in the shared torchrun worlds (tests/distributed/worlds.py); the reference runs only with a
test that compares with it.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed.harness import (
    TINY_RUN,
    assert_same_init,
    gathered,
    init_digests,
    losses,
    max_rel_diff,
    worst_tensor_diff,
)
from tests.distributed.worlds import register

V4 = ["--model.name", "deepseek_v4", "--model.flavor", "debugmodel", "--training.seq_len", "128",
      "--model.indexer_loss_coeff", "0.1"]
GRAD_TOL = 1e-4  # of each tensor's largest first-step gradient (summation order)
# Under TP the hyper-connections' mixing weights (hc_head.*, *_hc.base and .scale: largest |g| 5e-7 to 7e-6,
# sums over every token that cancel) move by at most 3.6e-9 absolute, up to 1.4e-3 of their largest: fp32's
# own error on them is that large (one process in fp32 against fp64: hc_head.base 1.0e-3, .scale 6.8e-4).
# Every other tensor moves by at most 2.5e-5 of its largest (mHC's fn; outside mHC 1.5e-6), as under FSDP x EP x TP.
MIXING_GRAD_TOL = 3e-3
MIXING = ("hc_head.", "_hc.base", "_hc.scale")

REFERENCE = register(__name__, "single", 1, [*TINY_RUN, *V4, "--training.local_batch_size", "8"], grads=True)

# (id, processes, local batch, overrides); global batch is 8 sequences everywhere.
LAYOUTS = [
    ("fsdp2_ep2", 2, 4, ["--parallelism.expert_parallel_degree", "2"]),
    ("pp2", 2, 8, ["--parallelism.pipeline_parallel_degree", "2",
                   "--parallelism.pipeline_parallel_microbatch_size", "2"]),
    ("tp2", 2, 8, ["--parallelism.tensor_parallel_degree", "2"]),
    ("cp2", 2, 8, ["--parallelism.context_parallel_degree", "2"]),
    # CP 2 with each block recomputed in backward: its gathers run again there, their backward once.
    ("cp2_ac", 2, 8, ["--parallelism.context_parallel_degree", "2", "--activation_checkpoint.mode", "full"]),
    # In the 4-process world: FSDP 2 x TP 2, each MoE layer's experts split over EP 2 (the FSDP ranks).
    ("fsdp2_ep2_tp2", 4, 4, ["--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
    # TP 2 x CP 2: each CP rank's two head-tail chunks, sequence-parallel over its TP pair between the blocks and
    # gathered whole for the attention, which runs its TP rank's heads over its CP rank's pieces.
    ("tp2_cp2", 4, 8, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.context_parallel_degree", "2"]),
    # HSDP: the weights sharded over each pair of ranks and replicated over the two pairs.
    ("hsdp2x2", 4, 2, ["--parallelism.data_parallel_replicate_degree", "2",
                       "--parallelism.data_parallel_shard_degree", "2"]),
]
CASES = [register(__name__, name, nproc, [*TINY_RUN, *V4, "--training.local_batch_size", str(batch), *overrides],
                  grads=True)
         for name, nproc, batch, overrides in LAYOUTS]


@pytest.mark.parametrize("world_case, reference_case, nproc", [(case, REFERENCE, layout[1])
                                                               for case, layout in zip(CASES, LAYOUTS)],
                         ids=[layout[0] for layout in LAYOUTS])
def test_deepseek_v4_layout_matches_single_process(worlds, world_case, reference_case, nproc):
    reference, folder = worlds.folder(reference_case), worlds.folder(world_case)
    name = world_case.split("::")[1]
    assert_same_init(folder, nproc, init_digests(reference, 1))
    grads, ref_grads = gathered(folder, nproc, "grads"), gathered(reference, 1, "grads")
    grad_diff, worst = worst_tensor_diff(grads, ref_grads)
    got, ref_losses = losses(folder), losses(reference)
    diff = max_rel_diff(got, ref_losses)
    print(f"\nDEEPSEEK-V4 LAYOUT {name:10s} procs {nproc}  max rel loss diff {diff:.2e}  grad diff {grad_diff:.1e} "
          f"({worst})")
    assert len(got) == 3 and got[-1] != got[0]
    for part in ("attn_hc.fn", "self_attn.compressor.gate_proj", "self_attn.sinks", "mlp.router",
                 "layers.0.mlp.experts.gate_up_proj", "layers.1.mlp.experts.down_proj", "hc_head.fn",
                 "layers.1.self_attn.indexer.q_b_proj", "layers.3.self_attn.indexer.compressor.kv_proj"):
        assert any(part in key for key in grads), part  # compared, not skipped
    if "tp2" in name:
        mixing = {k: t for k, t in ref_grads.items() if any(m in k for m in MIXING)}
        mixing_diff, mixing_worst = worst_tensor_diff({k: grads[k] for k in mixing}, mixing)
        assert mixing_diff <= MIXING_GRAD_TOL, f"{name}: {mixing_worst} off by {mixing_diff:.2e} of its largest"
        grads, ref_grads = ({k: t for k, t in g.items() if k not in mixing} for g in (grads, ref_grads))
        grad_diff, worst = worst_tensor_diff(grads, ref_grads)
        print(f"  mixing weights {mixing_diff:.1e} ({mixing_worst}), every other tensor {grad_diff:.1e} ({worst})")
        per_rank = [torch.load(folder / f"grads_rank{rank}.pt") for rank in range(nproc)]
        indexer = [k for k in per_rank[0] if ".indexer." in k]
        assert indexer and all(torch.equal(per_rank[0][k], per_rank[1][k]) for k in indexer), \
            "the TP ranks' indexers differ: they chose different entries"
    assert grad_diff <= GRAD_TOL, f"{name}: first-step gradient of {worst} off by {grad_diff:.2e} of its largest"
    assert diff <= 1e-5, f"{name}: max relative loss difference {diff:.2e}\n{got}\n{ref_losses}"
    if "ep2" in name:  # every MoE layer's routed experts split over the EP ranks, the hash-routed layer's too
        meshes = {k: v for rank in range(nproc)
                  for k, v in json.loads((folder / f"experts_rank{rank}.json").read_text()).items()}
        mesh = {"efsdp": 1, "ep": 2, **({"tp": 2} if "tp2" in name else {})}  # replicated over TP
        assert meshes == {f"layers.{i}.mlp.experts.gate_up_proj": mesh for i in range(4)}, meshes


# DDP 2 from a dense warm-up step (model.indexer_warmup_steps 1): in it only the indexer gets a gradient, so DDP
# must find the unused parameters (ModelSpec.parameters_may_go_unused) and leave their gradients None, as one
# process does; the two later steps attend sparsely and train every parameter.
WARMUP = ["--model.indexer_warmup_steps", "1"]
WARMUP_REFERENCE = register(__name__, "single_warmup", 1, [*TINY_RUN, *V4, *WARMUP, "--training.local_batch_size", "8"],
                            grads=True)
DDP2 = register(__name__, "ddp2_warmup", 2, [*TINY_RUN, *V4, *WARMUP, "--training.local_batch_size", "4",
                                            "--parallelism.data_parallel_replicate_degree", "2",
                                            "--parallelism.data_parallel_shard_degree", "1"], grads=True)


@pytest.mark.parametrize("world_case, reference_case", [(DDP2, WARMUP_REFERENCE)], ids=["ddp2_warmup"])
def test_deepseek_v4_ddp_through_the_indexer_warm_up_matches_single_process(worlds, world_case, reference_case):
    reference, folder = worlds.folder(reference_case), worlds.folder(world_case)
    assert_same_init(folder, 2, init_digests(reference, 1))
    grads, ref_grads = gathered(folder, 2, "grads"), gathered(reference, 1, "grads")
    assert ref_grads and all(".indexer." in name for name in ref_grads), sorted(ref_grads)  # the indexer's alone
    grad_diff, worst = worst_tensor_diff(grads, ref_grads)  # the same names: the unused ones have none either
    got, ref_losses = losses(folder), losses(reference)
    diff = max_rel_diff(got, ref_losses)
    print(f"\nDEEPSEEK-V4 LAYOUT ddp2_warmup procs 2  max rel loss diff {diff:.2e}  indexer grad diff {grad_diff:.1e} "
          f"({worst})")
    assert len(got) == 3 and got[-1] != got[0]
    assert grad_diff <= GRAD_TOL, f"ddp2_warmup: first-step gradient of {worst} off by {grad_diff:.2e} of its largest"
    assert diff <= 1e-5, f"ddp2_warmup: max relative loss difference {diff:.2e}\n{got}\n{ref_losses}"


# FSDP 2 x EP 2 with the auxiliary-loss-free bias update on (moe.load_balance_coeff): after each step every
# score-routed layer's bias moves by the tokens per expert summed over both ranks (the hash-routed layer has
# none), so steps 2 and 3 route by a moved bias; the losses and each step's tokens per expert equal one process.
BALANCE = ["--moe.load_balance_coeff", "0.01"]
BALANCE_REFERENCE = register(__name__, "single_balance", 1, [*TINY_RUN, *V4, *BALANCE, "--training.local_batch_size", "8"])
BALANCE_FSDP_EP = register(__name__, "fsdp2_ep2_balance", 2, [*TINY_RUN, *V4, *BALANCE, "--training.local_batch_size",
                                                              "4", "--parallelism.expert_parallel_degree", "2"])


@pytest.mark.parametrize("world_case, reference_case", [(BALANCE_FSDP_EP, BALANCE_REFERENCE)], ids=["fsdp2_ep2_balance"])
def test_deepseek_v4_routing_bias_update_matches_single_process(worlds, world_case, reference_case):
    from tests.distributed.harness import expert_loads

    folder, reference = worlds.folder(world_case), worlds.folder(reference_case)
    got, ref_losses = losses(folder), losses(reference)
    diff = max_rel_diff(got, ref_losses)
    loads, ref_loads, unmoved = expert_loads(folder), expert_loads(reference), expert_loads(worlds.folder(REFERENCE))
    print(f"\nDEEPSEEK-V4 LAYOUT fsdp2_ep2_balance procs 2  max rel loss diff {diff:.2e}")
    assert len(got) == 3 and got[-1] != got[0]
    assert sorted(ref_loads[0]) == ["0", "1", "2", "3"]  # the hash-routed layer 0 is counted too
    # The bias starts at 0: step 1 routes as without the update, and the moved bias reroutes later steps' tokens
    # in every score-routed layer; the hash-routed layer 0 routes the same tokens to the same experts throughout.
    assert ref_loads[0] == unmoved[0], (ref_loads[0], unmoved[0])
    assert all(ref_loads[2][i] != unmoved[2][i] for i in "123"), (ref_loads[2], unmoved[2])
    assert [load["0"] for load in ref_loads] == [load["0"] for load in unmoved]
    assert loads == ref_loads, f"fsdp2_ep2_balance: tokens per expert differ from one process\n{loads}\n{ref_loads}"
    assert diff <= 1e-5, f"fsdp2_ep2_balance: max relative loss difference {diff:.2e}\n{got}\n{ref_losses}"

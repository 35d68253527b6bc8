"""Qwen3 (per-head QK norm, tied embeddings, queries wider than dim) under every parallel layout
reproduces the single-process run: same initial weights bit for bit, the first step's gradient of
every parameter, and per-step losses within 1e-5 relative (fp32), on real torchrun + gloo.

Losses alone would miss a wrong gradient: clipping (always active here) and AdamW, both blind to the
scale of a gradient, turned an under-reduced q_norm/k_norm gradient under TP (each rank summing its
own heads only) into a loss drift of 6e-7 over 5 steps. So each run also writes its first step's
gradients (the tied table's is the sum of the embedding's and the output layer's).

DeepSeek-V3's debug model (latent attention, a dense first layer, grouped routing) takes the MoE
checks under TP 2, EP 2 x TP 2, EP 2 x FSDP 2, EP 2 x CP 2, EP 2 x PP 2 and HSDP, and with a
multi-token-prediction depth under TP 2 and EP 2 x FSDP 2.

The layout cases of each process count share one torchrun world (tests/distributed/worlds.py), which
also writes those gradients. This file is the torchrun script of pp_worker.py (every schedule, one
launch) with Qwen3's args (see the bottom).
"""

from __future__ import annotations

import json
import time

import pytest

from tests.distributed.harness import (
    TINY_RUN,
    assert_same_init,
    expert_loads,
    gathered,
    init_digests,
    lone_rank,
    losses,
    max_rel_diff,
    torchrun,
    worst_tensor_diff,
)
from tests.distributed.worlds import register
from titanctl.parallel.layouts.pipeline_stages import SCHEDULES

QWEN3 = ["--model.name", "qwen3", "--model.flavor", "debugmodel"]
QWEN3_UNTIED = ["--model.name", "qwen3", "--model.flavor", "debugmodel_untied"]
# Qwen3-MoE (8 experts, top-2): every parameter's gradient, routers included, is compared too, with
# both balancing methods on: the auxiliary loss's gradient is in the first step's, and the bias update
# changes the routing of later steps (each step's expert load is compared as well).
QWEN3_MOE = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel",
             "--moe.load_balance_coeff", "0.01", "--moe.router_aux_loss_coef", "0.01"]
# DeepSeek-V3's debug model: latent attention, a dense first layer, then shared and routed experts
# chosen within the best expert groups (sigmoid scores), with the same balancing.
DEEPSEEK_V3 = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel",
               "--moe.load_balance_coeff", "0.01", "--moe.router_aux_loss_coef", "0.01"]
# With a multi-token-prediction depth: its block, norms and projection, and the shared embedding and output
# layer's gradient from both losses.
DEEPSEEK_V3_MTP = [*DEEPSEEK_V3, "--model.mtp_layers", "1", "--model.mtp_loss_weight", "0.3"]
FLAVORS = {"tied": QWEN3, "untied": QWEN3_UNTIED, "moe": QWEN3_MOE, "deepseek": DEEPSEEK_V3,
           "deepseek_mtp": DEEPSEEK_V3_MTP}
PP_STEPS = 4  # pp_worker's default is 3: one more, so a wrong gradient shows in 3 losses


REFERENCES = {name: register(__name__, f"single_{name}", 1, [*TINY_RUN, *flavor, "--training.local_batch_size", "8"],
                             grads=True, always=True) for name, flavor in FLAVORS.items()}


@pytest.fixture(scope="module")
def references(worlds) -> dict[str, tuple[list[float], dict, dict, list]]:
    """One process, 8 sequences a step: the tied debugmodel, the untied one (pipeline layouts), the MoE ones."""
    out = {}
    for name, key in REFERENCES.items():
        folder = worlds.folder(key)
        out[name] = losses(folder), init_digests(folder, 1), gathered(folder, 1, "grads"), expert_loads(folder)
    return out






GRAD_TOL = 1e-4  # of the tensor's largest gradient: the layouts give up to 3e-6 (summation order)


TP2 = ["--parallelism.tensor_parallel_degree", "2"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]

# (id, reference, processes, local batch, overrides); global batch is 8 sequences everywhere.
LAYOUTS = [
    ("fsdp2", "tied", 2, 4, []),
    ("hsdp2x2", "tied", 4, 2, ["--parallelism.data_parallel_replicate_degree", "2"]),
    ("ddp2", "tied", 2, 4, ["--parallelism.data_parallel_replicate_degree", "2",
                            "--parallelism.data_parallel_shard_degree", "1"]),
    ("tp2_sp_loss_parallel", "tied", 2, 8, TP2),
    ("tp2_compile", "tied", 2, 8, [*TP2, "--compile.enable"]),
    # Also TP without loss parallel: the output layer (the tied table) gathers its logits.
    ("fsdp2_tp2_no_loss_parallel", "tied", 4, 4, [*TP2, "--parallelism.disable_loss_parallel"]),
    ("cp2", "tied", 2, 8, ["--parallelism.context_parallel_degree", "2"]),
    ("fsdp2_tp2_pp2", "untied", 8, 4, [*PP2, *TP2, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]),
    ("moe_fsdp2", "moe", 2, 4, []),
    ("moe_hsdp2x2", "moe", 4, 2, ["--parallelism.data_parallel_replicate_degree", "2"]),
    ("moe_ddp2", "moe", 2, 4, ["--parallelism.data_parallel_replicate_degree", "2",
                               "--parallelism.data_parallel_shard_degree", "1"]),
    ("moe_cp2_compile", "moe", 2, 8, ["--parallelism.context_parallel_degree", "2", "--compile.enable"]),
    ("moe_fsdp2_pp2", "moe", 4, 4, PP2),
    ("moe_tp2", "moe", 2, 8, TP2),
    ("moe_ep2", "moe", 2, 4, EP2),
    ("moe_ep2_tp2", "moe", 4, 4, [*EP2, *TP2]),
    ("moe_ep2_fsdp2", "moe", 4, 2, EP2),
    ("moe_ep2_hsdp2x2", "moe", 4, 2, [*EP2, "--parallelism.data_parallel_replicate_degree", "2"]),
    ("moe_ep2_pp2", "moe", 4, 4, [*EP2, *PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
    # Zero bubble splits each backward into the inputs' and the weights' parts: the all-to-all runs in the first.
    ("moe_ep2_pp2_zbv", "moe", 4, 4, [*EP2, *PP2, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]),
    ("moe_ep2_cp2_ac", "moe", 2, 8, [*EP2, "--parallelism.context_parallel_degree", "2",
                                     "--activation_checkpoint.mode", "full"]),
    # Latent attention split by heads (its latent projections whole on every rank), the experts replicated.
    ("deepseek_tp2", "deepseek", 2, 8, TP2),
    ("deepseek_ep2_tp2", "deepseek", 4, 4, [*EP2, *TP2]),
    ("deepseek_ep2_fsdp2", "deepseek", 4, 2, EP2),
    # Ring attention over the CP ranks (the values padded to the query/key width for flash attention).
    ("deepseek_ep2_cp2", "deepseek", 2, 8, [*EP2, "--parallelism.context_parallel_degree", "2"]),
    ("deepseek_ep2_pp2", "deepseek", 4, 4, [*EP2, *PP2]),
    ("deepseek_mtp_tp2", "deepseek_mtp", 2, 8, TP2),
    ("deepseek_mtp_ep2_fsdp2_compile", "deepseek_mtp", 4, 2, [*EP2, "--compile.enable"]),
    ("deepseek_hsdp2x2_ac", "deepseek", 4, 2, ["--parallelism.data_parallel_replicate_degree", "2",
                                               "--activation_checkpoint.mode", "full"]),
]


CASES = [register(__name__, name, nproc, [*TINY_RUN, *FLAVORS[ref], "--training.local_batch_size", str(local_batch),
                                         *overrides], grads=True)
         for name, ref, nproc, local_batch, overrides in LAYOUTS]


@pytest.mark.parametrize("world_case, ref, nproc, overrides",
                         [(case, ref, nproc, overrides) for case, (_, ref, nproc, _, overrides) in zip(CASES, LAYOUTS)],
                         ids=[layout[0] for layout in LAYOUTS])
def test_qwen3_layout_matches_single_process(references, worlds, world_case, ref, nproc, overrides):
    ref_losses, ref_init, ref_grads, ref_loads = references[ref]
    folder = worlds.folder(world_case)
    name = world_case.split("::")[1]
    assert_same_init(folder, nproc, ref_init)
    grad_diff, worst = worst_tensor_diff(gathered(folder, nproc, "grads"), ref_grads)
    got = losses(folder)
    diff = max_rel_diff(got, ref_losses)
    print(f"\nQWEN3 LAYOUT {name:45s} procs {nproc}  max rel loss diff {diff:.2e}  "
          f"grad diff {grad_diff:.1e} ({worst})")
    assert len(got) == 3 and got[-1] != got[0]
    assert grad_diff <= GRAD_TOL, f"{name}: first-step gradient of {worst} off by {grad_diff:.2e} of its largest"
    assert diff <= 1e-5, f"{name}: max relative loss difference {diff:.2e}\n{got}\n{ref_losses}"
    assert expert_loads(folder) == ref_loads, f"{name}: tokens per expert differ from one process"
    if ref in ("moe", "deepseek", "deepseek_mtp"):
        moe_layers = 3 if ref == "deepseek" else 4  # DeepSeek-V3's first layer is dense; the MTP block is MoE
        assert all(load and len(load) == moe_layers for load in ref_loads)  # every MoE layer, every step
        experts = json.loads((folder / "experts_rank0.json").read_text())
        ep = int(overrides[overrides.index(EP2[0]) + 1]) if EP2[0] in overrides else 1
        assert all(mesh.get("ep", 1) == ep for mesh in experts.values()) and (experts or ep == 1), experts


def test_qwen3_tied_pipeline_is_refused_before_the_process_group_forms(tmp_path):
    proc = lone_rank(2, ["train", *TINY_RUN, *QWEN3, "--training.local_batch_size", "4", *PP2,
                         "--job.dump_folder", str(tmp_path)])
    assert proc.returncode == 2, proc.stderr[-3000:]
    message = "pipeline_parallel_degree = 2 with a model whose output layer is its embedding (tied, qwen3"
    assert proc.stderr.count("\n") == 1 and message in proc.stderr and "untied flavor" in proc.stderr, proc.stderr


# ---------------------------------------------------------------- every schedule, one launch


def pp_args():
    from tests.distributed.workers import pp_worker
    from titanctl.models.qwen3.args import qwen3_args

    # Queries twice as wide as dim (4 heads x 32 over 64), as Qwen3's published sizes.
    return qwen3_args(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn=128, tied=False, head_dim=32,
                      vocab_size=256).replace(max_seq_len=pp_worker.SEQ)


@pytest.fixture(scope="module")
def pp_results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("qwen3_pp") / "result.json"
    start = time.perf_counter()
    torchrun(2, [__file__], ["--schedules", ",".join(SCHEDULES), "--out", str(out)], timeout=300)
    results = json.loads(out.read_text())
    print(f"\nQWEN3 torchrun with {len(SCHEDULES)} pipeline schedules: {time.perf_counter() - start:.1f} s "
          f"(reference {results['reference_seconds']:.1f} s)")
    return results["cases"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_qwen3_pipeline_schedule_matches_one_process(pp_results, schedule):
    r = pp_results[schedule]
    rel = max_rel_diff(r["pp_losses"], r["ref_losses"])
    norm_rel = max_rel_diff(r["pp_norms"], r["ref_norms"])
    print(f"\nQWEN3 PP {schedule:22s} stages per rank {[g['stages'] for g in r['layout']]}, max rel loss diff "
          f"{rel:.2e}, grad-norm {norm_rel:.2e}, max |param diff| {r['max_param_diff']:.2e}, {r['seconds']:.2f} s")
    assert len(r["pp_losses"]) == PP_STEPS
    assert rel <= 1e-5, (r["pp_losses"], r["ref_losses"])
    assert norm_rel <= 1e-5, (r["pp_norms"], r["ref_norms"])
    assert r["max_param_diff"] <= 5e-4  # as test_pipeline.PARAM_TOL
    assert r["pp_losses"][-1] != r["pp_losses"][0]  # training moved


# ---------------------------------------------------------------- the torchrun script


if __name__ == "__main__":  # pp_worker with a Qwen3 model
    from tests.distributed.workers import pp_worker

    pp_worker.ARGS = pp_args()
    pp_worker.STEPS = PP_STEPS
    pp_worker.main()

"""DeepSeek-V4's debug model (heavily compressed, compressed sparse with its indexer, sliding-window layers;
4 hyper-connection streams; the first MoE layer hash-routed) under FSDP 2 x EP 2, PP 2 and CP 2 reproduces the
single-process run, as test_family_layouts.py checks the other families: the same initial weights bit for
bit, the first step's gradient of every parameter (hyper-connections, compressors, sinks, routers, both
kinds of experts), per-step losses within 1e-5 relative (fp32).

Sequences of 128 tokens: a CSA layer has 32 compressed entries of which the indexer keeps 16, so its top-k
selects (at 64 it would keep every entry). The indexer trains by its own KL loss (model.indexer_loss_coeff,
titanctl/models/deepseek_v4/indexer_loss.py), on in every run: its gradients are compared too.

FSDP 2 x EP 2 on 2 processes: the dense weights sharded over both ranks, each MoE layer's routed experts
split 4 + 4 over them with tokens exchanged by all-to-all, the hash-routed layer's too. PP 2: blocks 0-1 and
2-3, the boundary carrying the streams and the token ids (titanctl/models/deepseek_v4/model.py). CP 2: each
rank holds head-tail chunks 0 and 3 or 1 and 2 of 32 tokens; the window's (32) preceding rows, the CSA
compressor's previous window and every chunk's compressed entries cross the ranks
(titanctl/parallel/layouts/sequence_pieces.py), the indexer's top-k over the gathered entries.

The cases run in the shared torchrun worlds (tests/distributed/worlds.py); the reference runs only with a
test that compares with it.
"""

from __future__ import annotations

import json

import pytest

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

REFERENCE = register(__name__, "single", 1, [*TINY_RUN, *V4, "--training.local_batch_size", "8"], grads=True)

# (id, processes, local batch, overrides); global batch is 8 sequences everywhere.
LAYOUTS = [
    ("fsdp2_ep2", 2, 4, ["--parallelism.expert_parallel_degree", "2"]),
    ("pp2", 2, 8, ["--parallelism.pipeline_parallel_degree", "2",
                   "--parallelism.pipeline_parallel_microbatch_size", "2"]),
    ("cp2", 2, 8, ["--parallelism.context_parallel_degree", "2"]),
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
    assert grad_diff <= GRAD_TOL, f"{name}: first-step gradient of {worst} off by {grad_diff:.2e} of its largest"
    assert diff <= 1e-5, f"{name}: max relative loss difference {diff:.2e}\n{got}\n{ref_losses}"
    if "ep2" in name:  # every MoE layer's routed experts split over the EP ranks, the hash-routed layer's too
        meshes = {k: v for rank in range(nproc)
                  for k, v in json.loads((folder / f"experts_rank{rank}.json").read_text()).items()}
        assert meshes == {f"layers.{i}.mlp.experts.gate_up_proj": {"efsdp": 1, "ep": 2} for i in range(4)}, meshes

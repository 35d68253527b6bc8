"""Ulysses context parallel (``parallelism.context_parallel_method = "ulysses"``) reproduces one process:
the first step's gradient of every parameter and the per-step losses (1e-5 relative, fp32), on real
torchrun + gloo, for Llama, gpt-oss and DeepSeek-V3's debug models, causal and block-causal.

One case per family x mask, CP 2 unless said: Llama's documents under CP 4 (its 2 key/value heads are
repeated to 4 so that every rank's 2 query heads find theirs), Llama causal composed with TP 2 (1
key/value head per TP rank, repeated to 2 for CP), gpt-oss causal and with documents
(sinks cut with the heads; sliding and full layers under their masks over the whole sequence),
DeepSeek-V3 causal and with documents (latent attention: per-head q, k, v after the up projection), and
the hybrid ``ulysses_ring`` under Llama's documents at CP 4 = ring 2 x Ulysses 2 (each pair of neighbouring
ranks all-to-alls its heads, the two pairs run the masked ring; titanctl/parallel/layouts/ulysses_ring.py).
Every case also runs FSDP, over the CP ranks (ParallelDims folds cp into the shard dims). The Llama
causal reference is test_layouts.py's, gpt-oss's and DeepSeek-V3's are test_family_layouts.py's; the
cases share their torchrun worlds.
"""

from __future__ import annotations

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
    worst_tensor_diff,
)
from tests.distributed.test_family_layouts import (
    DEEPSEEK_V3,
    DEFAULT_GRAD_TOL,
    DOCUMENTS,
    GPT_OSS,
    GRAD_TOL,
    REFERENCES,
    write_documents,
)
from tests.distributed.test_layouts import REFERENCE as LLAMA_REFERENCE
from tests.distributed.worlds import register

LLAMA = ["--model.name", "llama3", "--model.flavor", "debugmodel"]
FLAVORS = {"llama_documents": [*LLAMA, *DOCUMENTS], "deepseek_documents": [*DEEPSEEK_V3, *DOCUMENTS]}
OWN_REFERENCES = {name: register(__name__, f"single_{name}", 1, [*TINY_RUN, *flavor, "--training.local_batch_size", "8"],
                                 grads=True, always=True, prepare=write_documents if "documents" in name else None)
                  for name, flavor in FLAVORS.items()}
ALL_FLAVORS = FLAVORS | {"llama": LLAMA, "gpt_oss": GPT_OSS, "gpt_oss_documents": [*GPT_OSS, *DOCUMENTS], "deepseek": DEEPSEEK_V3}


def ulysses(cp: int) -> list[str]:
    return ["--parallelism.context_parallel_degree", str(cp), "--parallelism.context_parallel_method", "ulysses"]


def ulysses_ring(ring: int, inner: int) -> list[str]:
    return ["--parallelism.context_parallel_degree", str(ring * inner), "--parallelism.context_parallel_method",
            "ulysses_ring", "--parallelism.context_parallel_ulysses_degree", str(inner)]


# (id, reference, processes, local batch, overrides); global batch is 8 sequences everywhere.
LAYOUTS = [
    ("llama_documents_cp4", "llama_documents", 4, 8, ulysses(4)),
    ("llama_documents_ring2_ulysses2", "llama_documents", 4, 8, ulysses_ring(2, 2)),
    ("llama_tp2_cp2", "llama", 4, 8, [*ulysses(2), "--parallelism.tensor_parallel_degree", "2"]),
    ("gpt_oss_cp2", "gpt_oss", 2, 8, ulysses(2)),
    ("gpt_oss_documents_cp2", "gpt_oss_documents", 2, 8, ulysses(2)),
    ("deepseek_cp2", "deepseek", 2, 8, ulysses(2)),
    ("deepseek_documents_cp2", "deepseek_documents", 2, 8, ulysses(2)),
]
CASES = [register(__name__, name, nproc, [*TINY_RUN, *ALL_FLAVORS[ref], "--training.local_batch_size", str(batch),
                                         *overrides], grads=True,
                  prepare=write_documents if "documents" in ref or ref.startswith("gpt_oss") else None)
         for name, ref, nproc, batch, overrides in LAYOUTS]


@pytest.mark.parametrize("world_case, ref, nproc", [(case, ref, nproc) for case, (_, ref, nproc, _, _) in
                                                    zip(CASES, LAYOUTS)], ids=[layout[0] for layout in LAYOUTS])
def test_ulysses_matches_single_process(worlds, world_case, ref, nproc):
    ref_folder = worlds.folder(OWN_REFERENCES.get(ref) or REFERENCES.get(ref) or LLAMA_REFERENCE)
    folder = worlds.folder(world_case)
    assert_same_init(folder, nproc, init_digests(ref_folder, 1))
    grad_diff, worst = worst_tensor_diff(gathered(folder, nproc, "grads"), gathered(ref_folder, 1, "grads"))
    got, want = losses(folder), losses(ref_folder)
    diff = max_rel_diff(got, want)
    print(f"\nULYSSES {world_case:45s} procs {nproc}  max rel loss diff {diff:.2e}  grad diff {grad_diff:.1e} ({worst})")
    assert len(got) == 3 and got[-1] != got[0]
    tol = GRAD_TOL.get(ref, DEFAULT_GRAD_TOL)
    assert grad_diff <= tol, f"{world_case}: first-step gradient of {worst} off by {grad_diff:.2e} of its largest"
    assert diff <= 1e-5, f"{world_case}: max relative loss difference {diff:.2e}\n{got}\n{want}"
    assert expert_loads(folder) == expert_loads(ref_folder), f"{world_case}: tokens per expert differ"


def test_ulysses_refuses_heads_that_do_not_split(tmp_path):
    """Llama's debug model has 8 query heads: TP 2 x CP 8 would leave a rank half a head."""
    proc = lone_rank(16, ["train", *TINY_RUN, *LLAMA, "--training.local_batch_size", "8", *ulysses(8),
                          "--parallelism.tensor_parallel_degree", "2", "--job.dump_folder", str(tmp_path)])
    assert proc.returncode == 2, proc.stderr[-3000:]
    message = ("model n_heads = 8 is not divisible by tensor_parallel_degree x context_parallel_degree = 2 x 8; "
               "use context_parallel_method = ring")
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr

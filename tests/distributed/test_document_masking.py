"""Document masking (model.attn_mask_type = block_causal) under tensor, pipeline and context
parallelism reproduces the single-process losses (fp32, 1e-5 relative), on real torchrun + gloo.

The data is many short documents, so every window holds several: the mask must follow document
boundaries that fall inside a TP rank's heads, a pipeline microbatch and a CP rank's shard. The runs
share the torchrun worlds of tests/distributed/worlds.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.harness import TINY_RUN, losses, max_rel_diff, rows
from tests.distributed.worlds import ROOT, register

WORDS = "the of and to in a is that for it as with was on be by at this had not are but from or have".split()


def write_documents(root: Path) -> None:
    # 3 to 24 words each: about 5 to 30 tokens, so a 65-token window holds several documents.
    docs = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + (i * 5) % 22)) for i in range(600)]
    (root / "short_documents.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


RUN = [*TINY_RUN, "--model.n_layers", "2", "--training.steps", "3",
       "--training.dataset_path", f"{ROOT}/short_documents.jsonl", "--model.attn_mask_type", "block_causal"]
REFERENCE = register(__name__, "single", 1, [*RUN, "--training.local_batch_size", "8"], always=True,
                     prepare=write_documents)


@pytest.fixture(scope="module")
def run_args(tmp_path_factory):
    root = tmp_path_factory.mktemp("short_documents")
    write_documents(root)
    return [arg.replace(ROOT, str(root)) for arg in RUN]


@pytest.fixture(scope="module")
def reference(worlds):
    return losses(worlds.folder(REFERENCE))


def test_windows_hold_several_documents(run_args):
    """Else block_causal would equal causal and the layouts below would test nothing new."""
    from titanctl.config.recipe import load_config
    from titanctl.data.dataloader import TokenWindowLoader
    from titanctl.data.datasets import load_documents
    from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

    cfg = load_config(None, run_args)
    tokenizer = Tokenizer(DEFAULT_TOKENIZER_PATH)
    loader = TokenWindowLoader(load_documents("local", cfg.training.dataset_path), tokenizer,
                               seq_len=cfg.training.seq_len, global_batch_size=8, local_batch_size=8,
                               dp_rank=0, dp_degree=1, seed=cfg.training.seed)  # fmt: skip
    (inputs, _), = loader.next_step()
    starts = (inputs == tokenizer.bos_id).sum(dim=1)
    assert starts.min() >= 2, starts


# (id, processes, local batch, overrides); global batch is 8 sequences everywhere.
LAYOUTS = [
    ("tp2", 2, 8, ["--parallelism.tensor_parallel_degree", "2"]),
    ("pp2", 2, 8, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]),
    ("cp2", 2, 8, ["--parallelism.context_parallel_degree", "2"]),  # the default balancer: mask_aware
    ("cp2_head_tail", 2, 8, ["--parallelism.context_parallel_degree", "2",
                             "--parallelism.context_parallel_load_balancer", "head_tail"]),
]


CASES = [register(__name__, name, nproc, [*RUN, "--training.local_batch_size", str(local_batch), *overrides],
                  prepare=write_documents) for name, nproc, local_batch, overrides in LAYOUTS]


@pytest.mark.parametrize("world_case", CASES, ids=[layout[0] for layout in LAYOUTS])
def test_block_causal_layout_matches_single_process(reference, worlds, world_case):
    got = losses(worlds.folder(world_case))
    diff = max_rel_diff(got, reference)
    print(f"\nBLOCK_CAUSAL {world_case:40s} max rel loss diff {diff:.2e}")
    assert diff <= 1e-5, f"{world_case}: max relative loss difference {diff:.2e}\n{got}\n{reference}"


def test_mask_aware_balance_is_logged_and_beats_head_tail(worlds):
    """Both balancers equal one process (above); the logged imbalance says what each left: the mask-aware
    order's is lower on every step (these windows' documents differ step to step) and head-tail's is not 1."""
    by_balancer = {name: [r["cp_imbalance"] for r in rows(worlds.folder(case))]
                   for (name, *_), case in zip(LAYOUTS, CASES) if name.startswith("cp2")}
    print(f"\nCP_IMBALANCE {by_balancer}")
    mask_aware, head_tail = by_balancer["cp2"], by_balancer["cp2_head_tail"]
    assert len(mask_aware) == len(head_tail) == 3
    assert all(1.0 <= m < h for m, h in zip(mask_aware, head_tail)), by_balancer
    assert "cp_imbalance" not in rows(worlds.folder(REFERENCE))[0]  # one process: no CP, no column

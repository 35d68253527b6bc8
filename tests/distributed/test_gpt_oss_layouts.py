"""gpt-oss's debug model (attention sinks and biases, sliding-window layers of 32 positions over 64-token
windows alternating with full ones, YaRN; clamped-SwiGLU experts with biases, a biased router) under every
parallel layout reproduces the single-process run: the same initial weights bit for bit, the first step's
gradient of every parameter (sinks, biases, routers and experts included) and the per-step losses, on real
torchrun + gloo, in the shared worlds of tests/distributed/worlds.py.

Every bias starts non-zero (as torchtitan draws them), so a bias added once per TP rank (torchtitan #4245)
shows in the first loss. Under context parallelism every layer attends under its own mask (sliding or
full), and a block-causal document mask combines with the sliding window, whose windows here are longer
than some documents and shorter than others."""

from __future__ import annotations

import json
from pathlib import Path

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
from tests.distributed.worlds import ROOT, register

GPT_OSS = ["--model.name", "gpt_oss", "--model.flavor", "debugmodel",
           "--moe.load_balance_coeff", "0.01", "--moe.router_aux_loss_coef", "0.01"]
WORDS = "the of and to in a is that for it as with was on be by at this had not are but from or have".split()


def write_documents(root: Path) -> None:
    # 4 to 60 words each: some documents shorter than the 32-position window, some longer.
    docs = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(4 + (i * 13) % 57)) for i in range(400)]
    (root / "gpt_oss_documents.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


DOCUMENTS = ["--training.dataset_path", f"{ROOT}/gpt_oss_documents.jsonl", "--model.attn_mask_type", "block_causal"]
FLAVORS = {"causal": GPT_OSS, "documents": [*GPT_OSS, *DOCUMENTS]}
REFERENCES = {name: register(__name__, f"single_{name}", 1, [*TINY_RUN, *flavor, "--training.local_batch_size", "8"],
                             grads=True, always=True, prepare=write_documents)
              for name, flavor in FLAVORS.items()}

TP2 = ["--parallelism.tensor_parallel_degree", "2"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
# (id, reference, processes, local batch, overrides); global batch is 8 sequences everywhere.
LAYOUTS = [
    ("fsdp2", "causal", 2, 4, []),
    ("tp2", "causal", 2, 8, TP2),
    ("ep2", "causal", 2, 4, EP2),
    ("ep2_fsdp2", "causal", 4, 2, EP2),
    ("pp2", "causal", 2, 8, PP2),
    ("hsdp2x2", "causal", 4, 2, ["--parallelism.data_parallel_replicate_degree", "2"]),
    ("cp2", "causal", 2, 8, CP2),  # each layer gathers keys and values under its own mask: sliding or full
    ("cp2_documents", "documents", 2, 8, CP2),
]
CASES = [register(__name__, name, nproc, [*TINY_RUN, *FLAVORS[ref], "--training.local_batch_size", str(local_batch),
                                         *overrides], grads=True, prepare=write_documents)
         for name, ref, nproc, local_batch, overrides in LAYOUTS]
GRAD_TOL = 1e-5  # of each tensor's largest gradient






def test_documents_are_longer_and_shorter_than_the_window(tmp_path):
    """Else block_causal with a window would equal one of the two alone."""
    from titanctl.config.recipe import load_config
    from titanctl.data.dataloader import TokenWindowLoader
    from titanctl.data.datasets import load_documents
    from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
    from titanctl.models.gpt_oss.args import GPT_OSS_FLAVORS

    write_documents(tmp_path)
    cfg = load_config(None, [*TINY_RUN, *[a.replace(ROOT, str(tmp_path)) for a in DOCUMENTS]])
    tokenizer = Tokenizer(DEFAULT_TOKENIZER_PATH)
    loader = TokenWindowLoader(load_documents("local", cfg.training.dataset_path), tokenizer,
                               seq_len=cfg.training.seq_len, global_batch_size=8, local_batch_size=8,
                               dp_rank=0, dp_degree=1, seed=cfg.training.seed)  # fmt: skip
    (inputs, _), = loader.next_step()
    window = GPT_OSS_FLAVORS["debugmodel"].sliding_window
    assert window < cfg.training.seq_len
    lengths = [len(run) for row in inputs.tolist() for run in _documents(row, tokenizer.bos_id)]
    assert min(lengths) < window < max(lengths), lengths


def _documents(row: list[int], bos: int) -> list[list[int]]:
    starts = [i for i, t in enumerate(row) if t == bos] + [len(row)]
    return [row[a:b] for a, b in zip(starts, starts[1:])]


@pytest.fixture(scope="module")
def references(worlds) -> dict:
    out = {}
    for name, key in REFERENCES.items():
        folder = worlds.folder(key)
        out[name] = losses(folder), init_digests(folder, 1), gathered(folder, 1, "grads"), expert_loads(folder)
        # The biases matter from the first step.
        assert gathered(folder, 1, "init")["layers.0.attention.wo.bias"].abs().min() > 0
    return out


@pytest.mark.parametrize("world_case, ref, nproc, overrides",
                         [(case, ref, nproc, overrides) for case, (_, ref, nproc, _, overrides) in zip(CASES, LAYOUTS)],
                         ids=[layout[0] for layout in LAYOUTS])
def test_gpt_oss_layout_matches_single_process(references, worlds, world_case, ref, nproc, overrides):
    ref_losses, ref_init, ref_grads, ref_loads = references[ref]
    folder = worlds.folder(world_case)
    name = world_case.split("::")[1]
    assert_same_init(folder, nproc, ref_init)
    grad_diff, worst = worst_tensor_diff(gathered(folder, nproc, "grads"), ref_grads)
    got = losses(folder)
    diff = max_rel_diff(got, ref_losses)
    print(f"\nGPT-OSS LAYOUT {name:16s} procs {nproc}  max rel loss diff {diff:.2e}  grad diff {grad_diff:.1e} "
          f"({worst})")
    assert len(got) == 3 and got[-1] != got[0]
    assert grad_diff <= GRAD_TOL, f"{name}: first-step gradient of {worst} off by {grad_diff:.2e} of its largest"
    assert diff <= 1e-5, f"{name}: max relative loss difference {diff:.2e}\n{got}\n{ref_losses}"
    assert expert_loads(folder) == ref_loads, f"{name}: tokens per expert differ from one process"
    experts = json.loads((folder / "experts_rank0.json").read_text())
    ep = 2 if EP2[0] in overrides else 1
    assert all(mesh.get("ep", 1) == ep for mesh in experts.values()) and (experts or ep == 1), experts

"""Chat fine-tuning under every parallel layout gives one process's losses and first-step gradients: the
loss is the mean over every learned (assistant) token of the global batch, whatever splits it into
gradient-accumulation microbatches, pipeline microbatches, data-parallel and context-parallel ranks.

The conversations are short and uneven, so every window packs several of them and windows learn very
different numbers of tokens: a mean of per-microbatch (or per-rank) means would differ from the
single process by far more than the tolerance (tests/unit/data/test_chat_packing.py measures 1.5e-3 for
accumulation alone). The cases run in the torchrun worlds of tests/distributed/worlds.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.distributed.harness import TINY_RUN, gathered, losses, max_rel_diff
from tests.distributed.worlds import ROOT, register

WORDS = "the king said unto them light night river and was it not so be it well done yes no".split()
QWEN3 = ["--model.name", "qwen3", "--model.flavor", "debugmodel"]
QWEN3_UNTIED = ["--model.name", "qwen3", "--model.flavor", "debugmodel_untied"]  # pipelines need it untied
QWEN3_MOE = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]


def write_conversations(root: Path) -> None:
    """300 conversations of 1-3 exchanges, replies of 1-12 words: 15 to 60 tokens with the bundled tokenizer."""
    rng = random.Random(5)
    rows = []
    for _ in range(300):
        messages = [{"role": "system", "content": "Be brief."}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 6)))})
            messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))})
        rows.append({"messages": messages})
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


RUN = [*TINY_RUN, "--model.n_layers", "2", "--training.steps", "3", "--training.dataset", f"chat:{ROOT}/chat.jsonl",
       "--model.attn_mask_type", "block_causal"]
FLAVORS = {"tied": QWEN3, "untied": QWEN3_UNTIED, "moe": QWEN3_MOE}
REFERENCES = {name: register(__name__, f"single_{name}", 1, [*RUN, *flavor, "--training.local_batch_size", "8"],
                             grads=True, always=True, prepare=write_conversations)
              for name, flavor in FLAVORS.items()}

# (id, reference, processes, local batch, overrides); global batch is 8 windows everywhere.
LAYOUTS = [
    ("accumulation4", "tied", 1, 2, []),
    ("fsdp2", "tied", 2, 4, []),
    ("tp2", "tied", 2, 8, TP2),
    ("cp2", "tied", 2, 8, ["--parallelism.context_parallel_degree", "2"]),
    ("pp2", "untied", 2, 8, PP2),
    ("moe_ep2", "moe", 2, 4, EP2),
]
CASES = [register(__name__, name, nproc, [*RUN, *FLAVORS[ref], "--training.local_batch_size", str(local_batch),
                                         *overrides], grads=True, prepare=write_conversations)
         for name, ref, nproc, local_batch, overrides in LAYOUTS]




@pytest.fixture(scope="module")
def references(worlds):
    return {name: (losses(worlds.folder(key)), gathered(worlds.folder(key), 1, "grads"))
            for name, key in REFERENCES.items()}


@pytest.mark.parametrize("world_case, ref, nproc", [(case, ref, nproc) for case, (_, ref, nproc, _, _) in
                                                    zip(CASES, LAYOUTS)], ids=[layout[0] for layout in LAYOUTS])
def test_chat_layout_matches_single_process(references, worlds, world_case, ref, nproc):
    ref_losses, ref_grads = references[ref]
    folder = worlds.folder(world_case)
    got = losses(folder)
    grads = gathered(folder, nproc, "grads")
    assert grads.keys() == ref_grads.keys()
    grad_diff = max(((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in ref_grads.items())
    diff = max_rel_diff(got, ref_losses)
    print(f"\nCHAT LAYOUT {world_case.split('::')[1]:14s} procs {nproc}  max rel loss diff {diff:.2e}  "
          f"grad diff {grad_diff:.1e}")
    assert "of 300 conversations in" in worlds.stdout(world_case)  # the chat data was read
    assert len(got) == 3 and got[-1] != got[0]
    assert diff <= 1e-5, f"max relative loss difference {diff:.2e}\n{got}\n{ref_losses}"
    assert grad_diff <= 1e-5, f"first-step gradient off by {grad_diff:.2e} of its largest"

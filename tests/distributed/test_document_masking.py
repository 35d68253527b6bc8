"""Document masking (model.attn_mask_type = block_causal) under tensor, pipeline and context
parallelism reproduces the single-process losses (fp32, 1e-5 relative), on real torchrun + gloo.

The data is many short documents, so every window holds several: the mask must follow document
boundaries that fall inside a TP rank's heads, a pipeline microbatch and a CP rank's shard."""

from __future__ import annotations

import json
import time

import pytest

from tests.distributed.harness import TINY_RUN, WORKERS, losses, max_rel_diff, torchrun

WORKER = [str(WORKERS / "train_worker.py")]
WORDS = "the of and to in a is that for it as with was on be by at this had not are but from or have".split()


@pytest.fixture(scope="module")
def run_args(tmp_path_factory):
    folder = tmp_path_factory.mktemp("short_documents")
    path = folder / "docs.jsonl"
    # 3 to 24 words each: about 5 to 30 tokens, so a 65-token window holds several documents.
    docs = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + (i * 5) % 22)) for i in range(600)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return [*TINY_RUN, "--model.n_layers", "2", "--training.steps", "3", "--training.dataset_path", str(path),
            "--model.attn_mask_type", "block_causal"]  # fmt: skip


@pytest.fixture(scope="module")
def reference(run_args, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    torchrun(1, WORKER, [*run_args, "--training.local_batch_size", "8", "--job.dump_folder", str(out)])
    return losses(out)


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
    ("cp2", 2, 8, ["--parallelism.context_parallel_degree", "2"]),
]


@pytest.mark.parametrize("name, nproc, local_batch, overrides", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_block_causal_layout_matches_single_process(run_args, reference, tmp_path, name, nproc, local_batch, overrides):
    start = time.perf_counter()
    torchrun(nproc, WORKER, [*run_args, "--training.local_batch_size", str(local_batch), *overrides,
                             "--job.dump_folder", str(tmp_path)])
    seconds = time.perf_counter() - start
    got = losses(tmp_path)
    diff = max_rel_diff(got, reference)
    print(f"\nBLOCK_CAUSAL {name:6s} procs {nproc}  max rel loss diff {diff:.2e}  {seconds:5.1f} s")
    assert diff <= 1e-5, f"{name}: max relative loss difference {diff:.2e}\n{got}\n{reference}"

"""tps, tflops and MFU are per device under TP, PP and CP, and the step has no host sync there
(after the first step of the process, where a pipeline sends its stages' shapes).

Each run logs the step time it measured; the test recomputes tokens/s per device from the global
batch, that step time and the world size. The old accounting (tokens of a data-parallel rank, not
divided by tp·pp·cp) would be 2x off in each of these 2-process layouts.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from tests.distributed.harness import TINY_RUN, WORKERS, torchrun
from titanctl.data.tokenizer import Tokenizer
from titanctl.models.llama.args import LLAMA3_FLAVORS
from titanctl.models.llama.model import Transformer

WORKER = [str(WORKERS / "sync_train_worker.py")]
GLOBAL_BATCH, SEQ_LEN, N_LAYERS, PEAK = 8, 64, 4, 0.5  # as TINY_RUN; a fixed peak makes MFU checkable
STEPS, LOG_FREQ = 4, 2

LAYOUTS = [
    ("tp2", ["--parallelism.tensor_parallel_degree", "2"]),
    ("pp2", ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]),
    ("cp2", ["--parallelism.context_parallel_degree", "2"]),
]


def flops_per_token_by_hand() -> float:
    """6 x the parameters outside the embedding table, counted on a real model, + attention."""
    args = LLAMA3_FLAVORS["debugmodel"].replace(vocab_size=Tokenizer().vocab_size, n_layers=N_LAYERS)
    with torch.device("meta"):
        model = Transformer(args)
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("tok_embeddings"))
    return 6 * n + 12 * N_LAYERS * args.n_heads * args.head_dim * SEQ_LEN


@pytest.mark.parametrize("name, overrides", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_tps_and_mfu_are_per_device(tmp_path, name, overrides):
    args = [*TINY_RUN, "--training.local_batch_size", "8", "--training.steps", str(STEPS),
            "--metrics.log_freq", str(LOG_FREQ), "--metrics.peak_tflops", str(PEAK), *overrides,
            "--job.dump_folder", str(tmp_path)]
    started = time.perf_counter()
    torchrun(2, WORKER, args)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]

    fpt = flops_per_token_by_hand()
    for row in rows:
        expected_tps = GLOBAL_BATCH * SEQ_LEN / row["step_time"] / 2  # global tokens / step time / world size
        assert row["tps"] == pytest.approx(expected_tps, rel=0.01), (name, row)
        assert row["tflops"] == pytest.approx(expected_tps * fpt / 1e12, rel=0.01), (name, row)
        assert row["mfu"] == pytest.approx(100 * expected_tps * fpt / (PEAK * 1e12), rel=0.01), (name, row)
    # The step time is a real measurement: positive, and the logged windows fit in the run's wall time.
    assert all(r["step_time"] > 0 for r in rows)
    assert sum(r["step_time"] * LOG_FREQ for r in rows) < wall

    for rank in range(2):
        syncs = json.loads((tmp_path / f"host_syncs_rank{rank}.json").read_text())
        assert syncs["violations"] == [], "\n".join(syncs["violations"])
        assert syncs["allowed"] > 0
        if name != "pp2":  # pipeline stages exchange their shapes as Python objects in their first step
            assert syncs["first_step"] == [], "\n".join(syncs["first_step"])

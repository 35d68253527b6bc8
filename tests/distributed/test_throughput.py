"""tps, tflops and MFU are per device under TP, PP, CP and FSDP, and the step has no host sync
there (after the first step of the process, where a pipeline sends its stages' shapes).

The worker times each log window with its own clock (from the end of the process's first step,
which the Trainer leaves out of its rates, or the end of the previous log row, to the start of this
one); the test computes tokens/s per device by hand from the global batch, the steps in the window,
that time and the world size, and compares the logged tps, tflops and MFU with it. The old accounting (tokens of a data-parallel rank, not
divided by tp·pp·cp) would be 2x off in the TP, PP and CP layouts.

The FSDP 2 layout trains float8 with float8 all-gathers and precomputed scales (the GPU recipes'
settings), and checks that both really ran: the numbers alone cannot tell (see float8_probe.py).
The runs share the torchrun world of 2 processes (tests/distributed/worlds.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed.harness import TINY_RUN
from tests.distributed.workers.float8_probe import check_float8_all_gathers
from tests.distributed.worlds import register
from titanctl.data.tokenizer import Tokenizer
from titanctl.models.common.decoder import Transformer
from titanctl.models.llama.args import LLAMA3_FLAVORS

GLOBAL_BATCH, SEQ_LEN, N_LAYERS, PEAK = 8, 64, 4, 0.5  # as TINY_RUN; a fixed peak makes MFU checkable
STEPS, LOG_FREQ = 4, 2

FLOAT8_FSDP = ["--float8.enable_float8_linear", "--float8.enable_fsdp_float8_all_gather",
               "--float8.precompute_float8_dynamic_scale_for_fsdp"]
LAYOUTS = [
    ("tp2", ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    ("pp2", ["--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2",
             "--parallelism.pipeline_parallel_microbatch_size", "2"]),
    ("cp2", ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2"]),
    ("fsdp2_float8", ["--training.local_batch_size", "4", *FLOAT8_FSDP]),
]
FLOAT8_LINEARS = 4 * 7  # every linear of the 4 blocks; the output layer stays high precision


def flops_per_token_by_hand() -> float:
    """6 x the parameters outside the embedding table, counted on a real model, + attention."""
    args = LLAMA3_FLAVORS["debugmodel"].replace(vocab_size=Tokenizer().vocab_size, n_layers=N_LAYERS)
    with torch.device("meta"):
        model = Transformer(args)
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("tok_embeddings"))
    return 6 * n + 12 * N_LAYERS * args.n_heads * args.head_dim * SEQ_LEN


CASES = [register(__name__, name, 2, [*TINY_RUN, "--training.steps", str(STEPS), "--metrics.log_freq", str(LOG_FREQ),
                                       "--metrics.peak_tflops", str(PEAK), *overrides], probe=True)
         for name, overrides in LAYOUTS]


@pytest.mark.parametrize("world_case, name", [(case, layout[0]) for case, layout in zip(CASES, LAYOUTS)],
                         ids=[layout[0] for layout in LAYOUTS])
def test_tps_and_mfu_are_per_device(worlds, world_case, name):
    tmp_path = worlds.folder(world_case)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    windows = json.loads((tmp_path / "log_windows_rank0.json").read_text())
    assert [r["step"] for r in rows] == [w["step"] for w in windows] == [2, 4]

    fpt = flops_per_token_by_hand()
    previous_step = 1  # step 1 (compile, warm-up) is timed apart, in no window
    for row, window in zip(rows, windows):
        steps = row["step"] - previous_step
        previous_step = row["step"]
        # Tokens of the global batch in the window / the window's time measured by the worker / world size.
        expected_tps = GLOBAL_BATCH * SEQ_LEN * steps / window["seconds"] / 2
        # The two clocks start a window up to a GIL switch interval (5 ms) apart: leaving the hang
        # watchdog after a log row wakes its thread. Every wrong accounting is off 1.5x or more.
        assert row["tps"] == pytest.approx(expected_tps, rel=0.04), (name, row, window)
        assert row["step_time"] == pytest.approx(window["seconds"] / steps, rel=0.04), (name, row, window)
        assert row["tflops"] == pytest.approx(row["tps"] * fpt / 1e12, rel=0.01), (name, row)
        assert row["mfu"] == pytest.approx(100 * row["tps"] * fpt / (PEAK * 1e12), rel=0.01), (name, row)

    for rank in range(2):
        syncs = json.loads((tmp_path / f"host_syncs_rank{rank}.json").read_text())
        assert syncs["violations"] == [], "\n".join(syncs["violations"])
        assert syncs["allowed"] > 0
        if name != "pp2":  # pipeline stages exchange their shapes as Python objects in their first step
            assert syncs["first_step"] == [], "\n".join(syncs["first_step"])

    if name == "fsdp2_float8":
        for rank in range(2):
            check_float8_all_gathers(json.loads((tmp_path / f"float8_rank{rank}.json").read_text()), STEPS, FLOAT8_LINEARS)


"""Validation under every kind of layout equals one process: the same val_loss (within 1e-5 relative,
fp32) at the same steps, and the training losses still equal one process too, on real torchrun + gloo
(the torchrun worlds of tests/distributed/worlds.py)."""

from __future__ import annotations

import pytest

from tests.distributed.harness import max_rel_diff, rows
from tests.distributed.worlds import register

RUN = [
    "--model.n_layers", "2",
    "--training.seq_len", "32",
    "--training.global_batch_size", "8",
    "--training.steps", "4",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "1",
    "--lr_scheduler.lr_min", "0.5",  # the last step still moves the weights: its evaluation differs
    "--metrics.log_freq", "1",
    "--metrics.enable_tensorboard",
    "--activation_checkpoint.mode", "none",
    "--validation.enabled",
    "--validation.freq", "3",  # at steps 3 and 4 (the last)
    "--validation.steps", "2",
]


def validation_losses(folder) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in rows(folder) if "val_loss" in r}


def tensorboard_validation(folder) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder / "tb"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("validation/loss")}


REFERENCE = register(__name__, "single", 1, [*RUN, "--training.local_batch_size", "8"], always=True)


@pytest.fixture(scope="module")
def reference(worlds):
    return worlds.folder(REFERENCE)


# (id, processes, local batch, overrides); the global batch is 8 sequences everywhere.
LAYOUTS = [
    ("fsdp2", 2, 4, []),
    ("tp2_loss_parallel", 2, 8, ["--parallelism.tensor_parallel_degree", "2"]),
    ("pp2_1f1b", 2, 8, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]),
    # 4 processes: context parallel under data parallel (HSDP over dp_shard x cp), 2 microbatches.
    ("fsdp2_cp2", 4, 2, ["--parallelism.context_parallel_degree", "2"]),
]


CASES = [register(__name__, name, nproc, [*RUN, "--training.local_batch_size", str(local_batch), *overrides])
         for name, nproc, local_batch, overrides in LAYOUTS]


@pytest.mark.parametrize("world_case", CASES, ids=[layout[0] for layout in LAYOUTS])
def test_validation_loss_matches_single_process(reference, worlds, world_case):
    folder = worlds.folder(world_case)
    ref, got = validation_losses(reference), validation_losses(folder)
    assert list(ref) == list(got) == [3, 4] and ref[3] != ref[4]
    diff = max_rel_diff(list(got.values()), list(ref.values()))
    print(f"\nVALIDATION {world_case:40s} max rel val_loss diff {diff:.2e}")
    assert diff <= 1e-5, f"{world_case}: {got} vs one process {ref}"
    # Training is undisturbed by the evaluations in between, under this layout too.
    assert max_rel_diff([r["loss"] for r in rows(folder)], [r["loss"] for r in rows(reference)]) <= 1e-5
    scalars = tensorboard_validation(folder)
    assert list(scalars) == [3, 4] and all(scalars[s] == pytest.approx(got[s], rel=1e-6) for s in got)

"""Every parallel layout reproduces the single-process run: same initial weights bit for bit,
per-step losses within 1e-5 relative (fp32), on real torchrun + gloo. The cases of each process
count share one torchrun world (tests/distributed/worlds.py)."""

from __future__ import annotations

import pytest

from tests.distributed.harness import (
    TINY_RUN,
    assert_same_init,
    init_digests,
    lone_rank,
    losses,
    max_rel_diff,
    torchrun,
)
from tests.distributed.worlds import register

# Its first step's gradients too: test_ulysses_layouts.py compares Llama's against them.
REFERENCE = register(__name__, "single", 1, [*TINY_RUN, "--training.local_batch_size", "8"], grads=True, always=True)


@pytest.fixture(scope="session")
def reference(worlds):
    folder = worlds.folder(REFERENCE)
    return losses(folder), init_digests(folder, 1)


# (id, processes, local batch, overrides); global batch is 8 sequences everywhere.
LAYOUTS = [
    ("fsdp2", 2, 4, []),
    ("ddp2", 2, 4, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
    ("tp2", 2, 8, ["--parallelism.tensor_parallel_degree", "2"]),
    ("tp2_fused_rmsnorm", 2, 8, ["--parallelism.tensor_parallel_degree", "2", "--model.norm_type", "fused_rmsnorm"]),
    ("tp2_no_loss_parallel", 2, 8, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.disable_loss_parallel"]),
    ("fsdp2_reshard_never_full_ac", 2, 4, ["--parallelism.fsdp_reshard_after_forward", "never", "--activation_checkpoint.mode", "full"]),
    ("fsdp2_selective_ac_every_2", 2, 4, ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"]),
    ("tp2_selective_op_ac", 2, 8, ["--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]),
    ("fsdp2_compile", 2, 4, ["--compile.enable"]),
    # Compiled blocks under TP + SP (the debug recipe compiles): the embedding's local output is copied
    # before the first compiled block, whose input gradient torch 2.13 drops otherwise.
    ("tp2_compile", 2, 8, ["--parallelism.tensor_parallel_degree", "2", "--compile.enable"]),
    ("fsdp2_grad_accumulation", 2, 2, []),
    ("hsdp2x2", 4, 2, ["--parallelism.data_parallel_replicate_degree", "2"]),
    ("fsdp2_tp2", 4, 4, ["--parallelism.tensor_parallel_degree", "2"]),
    ("pp2_1f1b", 2, 8, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]),
    ("pp2_interleaved_accumulation", 2, 4, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", "--parallelism.pipeline_parallel_microbatch_size", "2"]),
    ("pp2_fsdp2", 4, 4, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]),
    ("pp2_tp2", 4, 8, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]),
    ("cp2_allgather", 2, 8, ["--parallelism.context_parallel_degree", "2"]),
    ("cp2_alltoall", 2, 8, ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_rotate_method", "alltoall"]),
    ("fsdp2_cp2", 4, 4, ["--parallelism.context_parallel_degree", "2"]),
    ("pp2_cp2", 4, 8, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.context_parallel_degree", "2",
                       "--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_microbatch_size", "2"]),
    # Replicas with CP: HSDP over (dp_replicate, cp). It used to be DDP over dp_replicate alone,
    # which never reduced the cp ranks' gradients (losses off by 4e-4 at step 2).
    ("replicate2_cp2", 4, 4, ["--parallelism.data_parallel_replicate_degree", "2",
                              "--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2"]),
    ("fsdp2_tp2_pp2", 8, 4, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "--parallelism.pipeline_parallel_microbatch_size", "2"]),
]


CASES = [register(__name__, name, nproc, [*TINY_RUN, "--training.local_batch_size", str(local_batch), *overrides])
         for name, nproc, local_batch, overrides in LAYOUTS]
BF16 = register(__name__, "fsdp2_bf16", 2, [*TINY_RUN, "--training.local_batch_size", "4",
                                            "--training.mixed_precision_param", "bfloat16"])


@pytest.mark.parametrize("world_case, nproc", [(case, layout[1]) for case, layout in zip(CASES, LAYOUTS)],
                         ids=[layout[0] for layout in LAYOUTS])
def test_layout_matches_single_process(reference, worlds, world_case, nproc):
    ref_losses, ref_init = reference
    folder = worlds.folder(world_case)
    assert_same_init(folder, nproc, ref_init)
    got = losses(folder)
    diff = max_rel_diff(got, ref_losses)
    print(f"\nLAYOUT {world_case:40s} procs {nproc}  max rel loss diff {diff:.2e}")
    assert diff <= 1e-5, f"{world_case}: max relative loss difference {diff:.2e}\n{got}\n{ref_losses}"


def test_torchrun_runs_the_cli_itself(reference, tmp_path):
    """`torchrun -m titanctl train` exactly as the README shows it."""
    ref_losses, _ = reference
    torchrun(2, ["-m", "titanctl", "train"], [*TINY_RUN, "--training.local_batch_size", "4",
                                              "--job.dump_folder", str(tmp_path)])
    assert max_rel_diff(losses(tmp_path), ref_losses) <= 1e-5


@pytest.mark.parametrize("world_case", [BF16])
def test_bf16_mixed_precision_within_bf16_tolerance(reference, worlds, world_case):
    ref_losses, _ = reference
    assert max_rel_diff(losses(worlds.folder(world_case)), ref_losses) <= 1e-2


@pytest.mark.parametrize(
    "nproc, overrides, message",
    [
        (2, ["--parallelism.tensor_parallel_degree", "3"], "world size 2 is not divisible by"),
        (2, ["--parallelism.data_parallel_shard_degree", "4"], "= 4, but the world size is 2"),
        (2, ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "63"], "training.seq_len (sequence parallel) = 63 is not divisible by tensor_parallel_degree = 2"),
        (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel", "--compile.enable"], "needs CUDA"),
        (2, ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "66"], "context parallel needs seq_len divisible by 2 x cp = 4 (load-balanced chunks), but seq_len is 66"),
        (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "--parallelism.pipeline_parallel_layers_per_stage", "2"], "schedule ZBVZeroBubble needs exactly 2 stages per rank"),
    ],
)
def test_impossible_layouts_are_refused_before_the_process_group_forms(tmp_path, nproc, overrides, message):
    """Rank 0 of a job whose other ranks never come refuses at once: it never waited for them."""
    proc = lone_rank(nproc, ["train", *TINY_RUN, "--training.local_batch_size", "4", *overrides,
                             "--job.dump_folder", str(tmp_path)])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and message in proc.stderr and "[rank 0]" in proc.stderr, proc.stderr
    assert not tmp_path.exists() or not any(tmp_path.iterdir())

"""`titanctl estimate-memory` in one process: fake tensors, a fake process group, exact bookkeeping."""

from __future__ import annotations

import subprocess
import time

import pytest
import torch.distributed as dist

from tests.conftest import REPO, TITANCTL
from titanctl.config.loader import load_config
from titanctl.models.llama import LLAMA3_FLAVORS
from titanctl.tools.memory import estimate as memory

TINY = ["--model.n_layers", "2", "--training.seq_len", "64"]


@pytest.fixture(autouse=True)
def no_process_group():
    assert not dist.is_initialized(), "another test left a process group behind"
    yield
    assert not dist.is_initialized(), "the estimate left its fake process group behind"


def estimate(recipe: str, world_size: int, overrides: list[str], **kwargs) -> memory.MemoryEstimate:
    return memory.estimate_memory(load_config(REPO / recipe, overrides), world_size, **kwargs)


def test_405b_on_512_ranks_is_fast_and_plausible():
    started = time.perf_counter()
    e = estimate("recipes/llama3_405b.toml", 512, [])
    seconds = time.perf_counter() - started
    assert seconds < 90, f"405B on 512 ranks took {seconds:.0f} s"  # ~15-40 s on 2 shared cores
    assert e.layout == "dp_shard 64 x tp 8" and e.vocab_size == 128_256 and e.layers_run == [4, 5]
    assert e.target_device == "cuda"
    assert any("128,256" in note for note in e.notes) and any("float8" in note for note in e.notes)
    # fp32 parameters sharded over all 512 ranks (FSDP 64 x TP 8), as stored; Adam's two moments alike.
    per_rank = e.num_params * 4 / 512
    assert e.parameter_bytes == pytest.approx(per_rank, rel=0.01)
    assert e.optimizer_state["exp_avg"] == e.optimizer_state["exp_avg_sq"] == pytest.approx(per_rank, rel=0.01)
    assert e.gradient_bytes == pytest.approx(per_rank, rel=0.01)
    # The steady-state peak holds parameters, Adam's state and full-AC activations: 4-80 GiB.
    assert 4 * per_rank < e.peak < 80 * 2**30
    assert e.peak == sum(e.categories.values())
    assert e.peak_step == 2 and e.peak > e.first_step_peak
    # With full AC each block keeps only its input: (2, 8192 / tp 8, 16384) bf16 = 64 MiB per block.
    assert e.categories["activations"] > 126 * 64 * 2**20


def test_8b_fsdp_parameters_gradients_and_adam_state_are_analytic():
    e = estimate("recipes/llama3_8b.toml", 8, ["--training.seq_len", "256"])
    n = LLAMA3_FLAVORS["8B"].replace(vocab_size=128_256).num_params()
    assert e.layout == "dp_shard 8"
    assert e.parameter_bytes == n * 4 // 8  # every dim of the 8B model divides by 8: no padding
    assert e.gradient_bytes == n * 4 // 8
    assert e.optimizer_state["exp_avg"] == e.optimizer_state["exp_avg_sq"] == n * 4 // 8
    assert e.categories["parameters"] == n * 4 // 8
    assert e.categories["optimizer state"] == 2 * n * 4 // 8 + e.optimizer_state["step"]


def test_deep_models_extrapolate_exactly():
    """Ten blocks from runs of four and five equal running all ten, byte for byte (FSDP x TP, full AC, bf16)."""
    args = ["--model.n_layers", "10", "--training.seq_len", "64", "--parallelism.tensor_parallel_degree", "2",
            "--activation_checkpoint.mode", "full", "--training.mixed_precision_param", "bfloat16"]
    fast = estimate("recipes/llama3_debug.toml", 4, args)
    full = estimate("recipes/llama3_debug.toml", 4, args, all_layers=True)
    assert fast.layers_run == [4, 5] and full.layers_run == [10]
    assert [(p.step, p.phase, p.peak, p.module) for p in fast.phases] == [
        (p.step, p.phase, p.peak, p.module) for p in full.phases
    ]
    assert fast.categories == full.categories
    assert (fast.parameter_bytes, fast.gradient_bytes, fast.optimizer_state) == (
        full.parameter_bytes, full.gradient_bytes, full.optimizer_state
    )


def test_second_step_equals_the_first_plus_adam_state():
    """The estimate runs one step and derives the second; running the second step agrees."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titanctl.tools.memory.tracker import untracked_sharding_propagation

    plan = memory.plan_estimate(load_config(REPO / "recipes/llama3_debug.toml", TINY), 2)
    runs = {}
    with memory.fake_process_group(2, 0):
        plan.dims.mesh  # noqa: B018
        with untracked_sharding_propagation():
            for steps in (1, 2):
                runs[steps] = memory._run_steps(
                    plan.cfg, plan.dims, plan.args, torch.device("cpu"), accum=1, steps=steps, period=1,
                    fake_mode=FakeTensorMode(allow_non_fake_inputs=True),
                )
    memory._steady_state(runs[1])
    assert {k: v.total for k, v in runs[1].peaks.items()} == {k: v.total for k, v in runs[2].peaks.items()}


def test_ddp_is_one_replica_plus_gradient_buckets():
    overrides = [*TINY, "--parallelism.data_parallel_replicate_degree", "2",
                 "--parallelism.data_parallel_shard_degree", "1"]
    ddp = estimate("recipes/llama3_debug.toml", 2, overrides)
    single = estimate("recipes/llama3_debug.toml", 1, TINY)
    assert ddp.ddp_bucket_bytes == single.parameter_bytes == ddp.parameter_bytes
    assert ddp.peak == single.peak + ddp.ddp_bucket_bytes
    assert any("DDP" in note for note in ddp.notes)


def test_pipeline_rank0_estimate_runs_its_stages():
    e = estimate("recipes/llama3_debug.toml", 2, [
        *TINY, "--model.n_layers", "4", "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
        "--parallelism.pipeline_parallel_microbatch_size", "2",
    ])
    assert e.layout == "pp 2" and e.pipeline_microbatches == 4
    single = estimate("recipes/llama3_debug.toml", 1, [*TINY, "--model.n_layers", "4"])
    assert e.parameter_bytes < single.parameter_bytes  # rank 0 holds stages 0 and 2 of 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world-size", "6", "--parallelism.tensor_parallel_degree", "4"],
         "world size 6 is not divisible by pp 1 x dp_replicate 1 x cp 1 x tp 4 = 4"),
        (["--world-size", "8", "--parallelism.data_parallel_shard_degree", "2"], "= 2, but the world size is 8"),
        (["--world-size", "2", "--validate"], "2 but 1 process(es) were started"),
        (["--world-size", "2", "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "63"],
         "not divisible by tensor_parallel_degree = 2"),
        (["--world-size", "2", "--device", "gpu"], "--device 'gpu' is not one of auto, cuda, cpu"),
    ],
)
def test_bad_requests_fail_in_one_line_with_exit_code_2(args, message):
    proc = subprocess.run(
        [*TITANCTL, "estimate-memory", "--config", "recipes/llama3_debug.toml", *args],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr

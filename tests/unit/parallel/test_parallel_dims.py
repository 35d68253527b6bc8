"""ParallelDims in process (degrees -> layout), and what fsdp_reshard_after_forward does to each module."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from titanctl.config.job_config import Parallelism
from titanctl.errors import ParallelError
from titanctl.parallel.layouts.dims import ParallelDims


def dims(world_size: int, **degrees) -> ParallelDims:
    cfg = Parallelism()
    for key, value in degrees.items():
        setattr(cfg, f"{key}_degree", value)
    return ParallelDims.from_config(cfg, world_size)


def test_shard_degree_minus_one_takes_the_ranks_left_over():
    d = dims(16, tensor_parallel=2, pipeline_parallel=2)
    assert (d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp) == (2, 1, 4, 1, 2)
    assert d.dp == 4 and d.fsdp_enabled and not d.ddp_enabled and not d.hsdp_enabled
    assert d.describe() == "pp 2 x dp_shard 4 x tp 2"


@pytest.mark.parametrize(
    "world, degrees, fsdp, ddp, hsdp",
    [
        (1, {}, False, False, False),
        (2, {"data_parallel_replicate": 2, "data_parallel_shard": 1}, False, True, False),
        (4, {"data_parallel_replicate": 2}, True, False, True),
        (2, {"context_parallel": 2, "data_parallel_shard": 1}, True, False, False),  # FSDP shards over cp
        # Replicas with context parallel: HSDP over (dp_replicate, cp); DDP would leave cp's grads unreduced.
        (4, {"data_parallel_replicate": 2, "data_parallel_shard": 1, "context_parallel": 2}, True, False, True),
        (2, {"tensor_parallel": 2}, False, False, False),
    ],
)
def test_which_data_parallelism(world, degrees, fsdp, ddp, hsdp):
    d = dims(world, **degrees)
    assert (d.fsdp_enabled, d.ddp_enabled, d.hsdp_enabled) == (fsdp, ddp, hsdp)
    assert d.world_size == d.pp * d.dp * d.cp * d.tp


def test_degrees_that_do_not_divide_the_world_name_the_numbers():
    with pytest.raises(ParallelError, match=r"world size 6 is not divisible by pp 1 x dp_replicate 1 x cp 1 x tp 4 = 4"):
        dims(6, tensor_parallel=4)
    with pytest.raises(ParallelError, match=r"= 8, but the world size is 4"):
        dims(4, data_parallel_shard=4, tensor_parallel=2)


def test_expert_parallel_splits_dp_shard_times_cp():
    d = dims(8, data_parallel_shard=2, context_parallel=2, tensor_parallel=2, expert_parallel=4)
    assert d.ep == 4 and d.world_size == 8 and d.describe() == "dp_shard 2 x cp 2 x tp 2 x (experts: ep 4)"
    with pytest.raises(ParallelError, match=r"expert_parallel_degree = 4 must divide data_parallel_shard_degree 2 x "
                                            r"context_parallel_degree 1 = 2: experts are split over those ranks"):
        dims(4, tensor_parallel=2, expert_parallel=4)
    with pytest.raises(ParallelError, match=r"expert_parallel_degree = 2 must divide .* = 1"):  # DDP only
        dims(2, data_parallel_replicate=2, data_parallel_shard=1, expert_parallel=2)


@pytest.mark.parametrize(
    "family, flavor, ep, message",
    [
        ("llama3", "debugmodel", 2, r"expert_parallel_degree = 2 with a model without experts \(llama3 flavor "
                                    r"debugmodel\): use an MoE family such as qwen3_moe"),
        ("qwen3_moe", "debugmodel", 16, r"expert_parallel_degree = 16 does not divide the 8 experts of qwen3_moe"),
    ],
)
def test_expert_parallel_needs_experts_it_can_split(family, flavor, ep, message):
    with pytest.raises(ParallelError, match=message):
        check_family_layout(family, flavor, dims(ep, expert_parallel=ep))


@pytest.mark.parametrize("overrides, why", [
    (["--parallelism.context_parallel_method", "ulysses"], "context_parallel_method = ulysses"),
    (["--model.attn_mask_type", "block_causal"], "model.attn_mask_type = block_causal"),
    (["--model.name", "gpt_oss"], "gpt_oss's attention sinks and sliding windows"),
    (["--model.name", "qwen3_5", "--model.flavor", "debugmodel_untied"], "qwen3_5's Gated DeltaNet layers"),
])
def test_context_parallel_inside_pipeline_stages_is_the_causal_ring_only(overrides, why):
    """Inside pipeline stages only ring attention over causal masks is built (the ring case itself:
    tests/distributed/test_layouts.py pp2_cp2)."""
    from titanctl.config.recipe import load_config
    from titanctl.models.registry import model_args_from_config
    from titanctl.parallel.layouts.build import check_layout

    layout = dims(4, pipeline_parallel=2, context_parallel=2, data_parallel_shard=1)
    cfg = load_config(None, overrides)
    with pytest.raises(ParallelError, match=f"context_parallel_degree = 2 with pipeline_parallel_degree = 2 runs "
                                            f"ring attention over causal masks only, not {why}"):
        check_layout(cfg, layout, model_args_from_config(cfg.model, 256, 64))
    ring = load_config(None, [])
    check_layout(ring, layout, model_args_from_config(ring.model, 256, 64))


def check_family_layout(family: str, flavor: str, layout: ParallelDims) -> None:
    from titanctl.config.recipe import load_config
    from titanctl.models.registry import model_args_from_config
    from titanctl.parallel.layouts.build import check_layout

    cfg = load_config(None, ["--model.name", family, "--model.flavor", flavor])
    check_layout(cfg, layout, model_args_from_config(cfg.model, 256, 64))


def test_fsdp_reshard_after_forward_always_means_every_module():
    """After forward, a resharded module holds its sharded DTensor parameters again; "always" must
    reshard the last block and the root too, also under pipelining (one rank, in a subprocess)."""
    code = textwrap.dedent(
        """
        import os, torch, torch.distributed as dist
        from torch.distributed.tensor import DTensor
        from torch.distributed.device_mesh import init_device_mesh
        from titanctl.models.llama.args import LLAMA3_FLAVORS
        from titanctl.models.common.decoder import Transformer
        from titanctl.parallel.layouts.data_parallel import apply_fsdp
        from titanctl.parallel.layouts.weight_init import initialize_weights

        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        args = LLAMA3_FLAVORS["debugmodel"].replace(vocab_size=64, n_layers=2, max_seq_len=16)
        for mode in ("always", "default", "never"):
            for pipelined in (False, True):
                model = Transformer(args)
                initialize_weights(model, seed=0)
                apply_fsdp(model, init_device_mesh("cpu", (1,)), param_dtype=torch.float32,
                           reduce_dtype=torch.float32, reshard_after_forward=mode, pipelined=pipelined)
                model(torch.zeros(1, 8, dtype=torch.long))
                sharded = [isinstance(p, DTensor) for n, p in model.named_parameters()
                           if n in ("layers.0.attention.wq.weight", "layers.1.attention.wq.weight", "output.weight")]
                print(mode, pipelined, *sharded)
        dist.destroy_process_group()
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in proc.stdout.splitlines()}
    # (first block, last block, root)
    assert rows["always", "False"] == ["True", "True", "True"]
    assert rows["always", "True"] == ["True", "True", "True"]
    assert rows["default", "False"] == ["True", "False", "True"]  # the last block is needed right away
    assert rows["default", "True"] == ["False", "False", "False"]  # pipelines keep everything gathered
    assert rows["never", "False"] == ["False", "False", "False"]


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV", "InterleavedZeroBubble"])
def test_zero_bubble_schedules_refuse_op_level_selective_checkpointing_before_training(schedule):
    """They backward each stage twice (inputs, then weights); op-level SAC allows one backward per region and
    failed at the first step (RuntimeError: Trying to backward an extra time)."""
    from titanctl.config.recipe import load_config
    from titanctl.models.registry import model_args_from_config
    from titanctl.parallel.layouts.build import check_layout

    overrides = ["--parallelism.pipeline_parallel_schedule", schedule, "--activation_checkpoint.mode", "selective"]
    layout = dims(2, pipeline_parallel=2, data_parallel_shard=1)
    cfg = load_config(None, [*overrides, "--activation_checkpoint.selective_ac_option", "op"])
    with pytest.raises(ParallelError, match=rf"pipeline_parallel_schedule = {schedule} runs each backward in two "
                                            r"passes, which activation_checkpoint.selective_ac_option = 'op' forbids"):
        check_layout(cfg, layout, model_args_from_config(cfg.model, 256, 64))
    every_second = load_config(None, [*overrides, "--activation_checkpoint.selective_ac_option", "2"])
    check_layout(every_second, layout, model_args_from_config(every_second.model, 256, 64))


@pytest.mark.parametrize("device, set_before, expected", [
    ("cuda", None, ":4096:8"),  # torch raises at the first CUDA matmul in deterministic mode without it
    ("cuda", ":16:8", ":16:8"),  # the user's own setting is kept
    ("cpu", None, None),  # no cuBLAS
])
def test_deterministic_training_sets_the_cublas_workspace_on_cuda(monkeypatch, device, set_before, expected):
    import torch

    from titanctl.parallel.runtime.env import use_deterministic_algorithms

    if set_before is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", set_before)
    try:
        use_deterministic_algorithms(torch.device(device))
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == expected

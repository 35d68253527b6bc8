"""The layouts titanctl rl refuses, each in one line naming the key, before any model is built."""

from __future__ import annotations

import pytest

from titanctl.config.recipe import load_config
from titanctl.errors import ParallelError
from titanctl.models.registry import model_args_from_config
from titanctl.parallel.layouts.dims import ParallelDims
from titanctl.rl.layouts import check_rl_layout


def check(world: int, *overrides: str) -> None:
    cfg = load_config(None, ["--parallelism.data_parallel_shard_degree", "1", *overrides], command="rl")
    args = model_args_from_config(cfg.model, 512, cfg.training.seq_len)
    check_rl_layout(cfg, ParallelDims.from_config(cfg.parallelism, world), args)


@pytest.mark.parametrize("key", ["pipeline_parallel_degree", "context_parallel_degree"])
def test_pipeline_and_context_parallelism_are_refused(key):
    with pytest.raises(ParallelError, match=rf"^parallelism.{key} = 2: titanctl rl samples with the training model, "
                                            "and a decode step cannot be split that way"):
        check(2, f"--parallelism.{key}", "2", "--model.n_layers", "2")


def test_batch_invariance_past_two_tensor_parallel_ranks_is_refused():
    check(2, "--parallelism.tensor_parallel_degree", "2", "--rl.batch_invariant", "true")  # exact: runs
    check(4, "--parallelism.tensor_parallel_degree", "4")  # the default mode: runs
    with pytest.raises(ParallelError, match=r"^rl.batch_invariant with parallelism.tensor_parallel_degree = 4: gloo "
                                            r"sums more than two partial sums in an order"):
        check(4, "--parallelism.tensor_parallel_degree", "4", "--rl.batch_invariant", "true")


def test_a_plan_that_always_shards_the_sequence_has_no_variant_for_decoding():
    """apply_tp refuses before it touches the mesh (DeepSeek-V3's plan has no sequence_parallel=False)."""
    import torch

    from titanctl.models.registry import build_model
    from titanctl.parallel.layouts.tensor_parallel import apply_tp

    cfg = load_config(None, ["--model.name", "deepseek_v3", "--model.n_layers", "2"], command="train")
    with torch.device("meta"):
        model = build_model(model_args_from_config(cfg.model, 512, cfg.training.seq_len))
    with pytest.raises(ParallelError, match=r"^deepseek_v3's tensor-parallel plan always shards the sequence"):
        apply_tp(model, None, loss_parallel=False, async_tp=False, compiled=False, sequence_parallel=False)

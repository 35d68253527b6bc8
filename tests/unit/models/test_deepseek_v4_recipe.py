"""DeepSeek-V4 in titanctl: the debug recipe's model trains (the loss falls in a few steps, drawn by titanctl's
own init), and what a recipe cannot run is refused in one line: the indexer's top-k beyond the compressed
length of the run's sequences, a schedule of the wrong length, heads that tensor parallelism does not divide,
context parallelism in chunks that cut a compressed window or as Ulysses, the Hugging Face format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from titanctl.config.recipe import load_config
from titanctl.errors import ConfigError
from titanctl.models.registry import build_model, get_spec, model_args_from_config
from titanctl.parallel.layouts.weight_init import initialize_weights

RECIPE = Path(__file__).parents[3] / "recipes" / "deepseek_v4_debug.toml"
VOCAB = 4352  # the bundled tokenizer's


def recipe_args(*overrides: str, seq_len: int | None = None):
    cfg = load_config(RECIPE, list(overrides))
    return model_args_from_config(cfg.model, VOCAB, seq_len or cfg.training.seq_len)


def test_the_debug_model_learns():
    """Six AdamW steps on one batch of the recipe's length at its lr: the loss falls below 90% of the first."""
    args = recipe_args()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(args.replace(max_seq_len=64))
    model.to_empty(device="cpu")
    initialize_weights(model, seed=0)
    tokens = torch.randint(0, VOCAB, (2, 65), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(6):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(torch.log(torch.tensor(float(VOCAB))).item(), rel=0.1)
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("overrides, seq_len, message", [
    ((), 32, "model deepseek_v4: index_topk 16 is larger than the compressed length 8 (seq_len 32 / compress rate 4)"),
    (("--model.n_layers", "2"), None, "model deepseek_v4: layer_types has 4 entries for 2 layers"),
])
def test_a_recipe_the_model_cannot_run_is_refused_in_one_line(overrides, seq_len, message):
    with pytest.raises(ConfigError) as err:
        recipe_args(*overrides, seq_len=seq_len)
    assert str(err.value) == message


def test_tensor_parallel_splits_the_query_heads_and_keeps_the_shared_parts_whole():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = get_spec("deepseek_v4").tp_plan
    block = plan.block(recipe_args())
    assert {name for name, style in block.items() if isinstance(style, (ColwiseParallel, RowwiseParallel))} == {
        "self_attn.q_b_proj", "self_attn.o_b_proj"}
    assert set(plan.head_params) == {"self_attn.sinks", "self_attn.o_a_proj.weight"}  # with the heads
    assert plan.summed_gradient == ("self_attn.shared_kv",)  # the one KV head every rank's heads read
    assert {"self_attn.kv_proj", "self_attn.indexer.q_b_proj", "self_attn.indexer.compressor.kv_proj",
            "self_attn.compressor.gate_proj", "mlp.router"} <= set(plan.replicated)
    assert "hc_head" in plan.root(True)


@pytest.mark.parametrize("tp, message", [(3, "model n_heads = 4 is not divisible by tensor_parallel_degree = 3"),
                                         (4, "model compressed_attention.o_groups = 2 is not divisible by "
                                             "tensor_parallel_degree = 4")])
def test_heads_or_head_groups_a_degree_does_not_divide_are_refused_in_one_line(tp, message):
    from titanctl.errors import ParallelError
    from titanctl.parallel.layouts.tensor_parallel import check_tp

    check_tp(recipe_args(), 2, 128)  # 4 heads in 2 groups: 2 ways
    with pytest.raises(ParallelError) as err:
        check_tp(recipe_args(), tp, 192)
    assert str(err.value) == message


def test_packed_documents_are_refused_in_one_line():
    with torch.device("meta"):
        model = build_model(recipe_args())
    with pytest.raises(ValueError, match="^deepseek_v4 trains on whole windows only: set model.attn_mask_type = .causal."):
        model(torch.zeros(1, 8, dtype=torch.long, device="meta"), positions=torch.zeros(1, 8, dtype=torch.long))


@pytest.mark.parametrize("overrides, message", [
    (["--parallelism.context_parallel_degree", "4", "--training.seq_len", "64"],
     r"^context_parallel_degree = 4 cuts training.seq_len 64 into 2 x cp chunks of 8 tokens, which do not hold whole "
     r"heavily_compressed_attention windows of 16: use a seq_len that is a multiple of 128 or a smaller degree$"),
    (["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method", "ulysses"],
     r"^[^\n]*use context_parallel_method = ring$"),
], ids=["chunks_split_windows", "ulysses"])
def test_a_context_parallel_layout_it_cannot_run_is_refused_in_one_line(overrides, message):
    """Ring CP runs (tests/unit/parallel/test_deepseek_v4_cp.py); chunks that cut a compressed window, and
    Ulysses (whatever the schedule), are refused before any rank connects."""
    from titanctl.errors import ParallelError
    from titanctl.parallel.layouts.build import check_layout
    from titanctl.parallel.layouts.dims import ParallelDims

    cfg = load_config(RECIPE, overrides)
    with pytest.raises(ParallelError, match=message):
        check_layout(cfg, ParallelDims.from_config(cfg.parallelism, int(overrides[1])),
                     model_args_from_config(cfg.model, VOCAB, cfg.training.seq_len))
    ring = load_config(RECIPE, ["--parallelism.context_parallel_degree", "2"])
    check_layout(ring, ParallelDims.from_config(ring.parallelism, 2), recipe_args())


def test_ulysses_is_refused_for_a_schedule_of_sliding_layers_alone():
    """Ulysses' own check lets a schedule of softmax-attention layers through; V4's attention is no Ulysses kernel."""
    from titanctl.errors import ParallelError

    sliding = recipe_args().replace(layer_types=("sliding_attention",) * 4)
    with pytest.raises(ParallelError, match=r"^deepseek_v4 does not run with context_parallel_method = ulysses \(its "
                                            r"attention reads its neighbours by sequence chunks, not by heads\); "
                                            r"use context_parallel_method = ring$"):
        get_spec("deepseek_v4").check_context_parallel(sliding, 256, 2, "ulysses")


@pytest.mark.parametrize("key", ["router_aux_loss_coef"])  # load_balance_coeff trains (test_deepseek_v4_balance.py)
def test_a_balancing_key_its_moe_layers_do_not_train_by_is_refused_in_one_line(key):
    from titanctl.train.moe_balance import check_moe_keys

    cfg = load_config(RECIPE, [f"--moe.{key}", "0.001"])
    with pytest.raises(ConfigError, match=rf"^moe.{key} = 0.001: deepseek_v4's .*; set it to 0$"):
        check_moe_keys(cfg.moe, recipe_args(), cfg.model.name)


def test_a_run_resumes_bit_for_bit_though_no_gradient_reached_its_indexer(tmp_path):
    """Without its loss the indexer never gets a gradient, so the optimizer holds no state for it and a
    checkpoint none: the resumed run leaves it without state too, and its step equals the run's."""
    import json
    import shutil

    from titanctl.train.trainer import Trainer

    def run(out):
        Trainer(load_config(RECIPE, ["--training.steps", "2", "--checkpoint.enable_checkpoint", "true",
                                     "--checkpoint.interval", "1", "--metrics.enable_tensorboard", "false",
                                     "--job.dump_folder", str(out)])).train()
        return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}

    whole = run(tmp_path / "whole")
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "whole" / "checkpoint" / "step-1", tmp_path / "resumed" / "checkpoint" / "step-1")
    assert run(tmp_path / "resumed") == {2: whole[2]}

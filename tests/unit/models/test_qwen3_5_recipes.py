"""The Qwen3.5 debug recipes train as shipped (in-process, shortened to 24 steps of 4 x 128 tokens): the
loss falls well below its start, block-causal (packed documents) as the recipes' causal default."""

from __future__ import annotations

import json

import pytest

from titanctl.config.recipe import load_config
from titanctl.train.trainer import Trainer

SHORT = ["--training.steps", "24", "--training.seq_len", "128", "--training.local_batch_size", "4",
         "--lr_scheduler.warmup_steps", "4", "--checkpoint.enable_checkpoint", "false",
         "--metrics.enable_tensorboard", "false"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe, mask", [("qwen3_5_debug", "causal"), ("qwen3_5_moe_debug", "block_causal")])
def test_the_debug_recipe_trains(repo, tmp_path, recipe, mask):
    cfg = load_config(repo / "recipes" / f"{recipe}.toml",
                      [*SHORT, "--job.dump_folder", str(tmp_path), "--model.attn_mask_type", mask])
    Trainer(cfg).train()
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 24
    assert sum(losses[-4:]) / 4 < losses[0] - 1.0, losses


def test_a_recipe_depth_override_keeps_the_schedule(repo):
    from titanctl.models.registry import build_model, model_args_from_config

    cfg = load_config(repo / "recipes" / "qwen3_5_debug.toml", ["--model.n_layers", "6"])
    args = model_args_from_config(cfg.model, 4352, cfg.training.seq_len)
    assert args.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 2
    kinds = [type(block.attention).__name__ for block in build_model(args.replace(dim=64)).layers.values()]
    assert kinds == ["GatedDeltaNet"] * 3 + ["GatedAttention"] + ["GatedDeltaNet"] * 2

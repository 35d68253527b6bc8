"""DeepSeek-V4's auxiliary-loss-free bias update (moe.load_balance_coeff), by the shared mechanism
(titanctl/train/moe_balance.py) as DeepSeek-V3's: a training forward counts each layer's tokens per expert
(once, also under activation checkpointing); after the step every score-routed layer's bias moves by the
coefficient toward its under-loaded experts, while the hash-routed layer (a fixed token -> experts table, no
bias, as transformers' DeepseekV4HashRouter) is counted and left alone. A run's moved bias is saved and
resumed by its DCP checkpoints and exported to Hugging Face as the Hub's ``layers.N.ffn.gate.bias``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.checkpoint import checkpoint

from titanctl.config.recipe import load_config
from titanctl.models.registry import build_model, model_args_from_config
from titanctl.parallel.layouts.dims import ParallelDims
from titanctl.parallel.layouts.weight_init import initialize_weights
from titanctl.train.moe_balance import MoEBalance, check_moe_keys

RECIPE = Path(__file__).parents[3] / "recipes" / "deepseek_v4_debug.toml"
VOCAB = 4352  # the bundled tokenizer's
SEQ = 64  # the CSA layers' 16 compressed entries: the indexer's top-k (16) keeps them all
COEFF = 0.01
ONE_PROCESS = ParallelDims(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, world_size=1)


def debug_model():
    cfg = load_config(RECIPE, ["--moe.load_balance_coeff", str(COEFF)])
    args = model_args_from_config(cfg.model, VOCAB, SEQ)
    check_moe_keys(cfg.moe, args, cfg.model.name)  # the key is no longer refused
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    initialize_weights(model, seed=0)
    return model, args, cfg.moe


def test_a_step_moves_every_score_routed_bias_by_its_counts_and_leaves_the_hash_layer_alone():
    model, args, moe = debug_model()
    layers = {int(i): block.mlp for i, block in model.layers.items()}
    assert [m.hashed for m in layers.values()] == [True, False, False, False]
    assert not hasattr(layers[0], "expert_bias")  # a table, no bias (transformers' hash router holds none)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a bias already moved (a checkpoint's): the step adds to it, and it routes
        for m in list(layers.values())[1:]:
            m.expert_bias.copy_(torch.randn(args.moe.num_experts, generator=gen) * 0.05)
    before = {i: m.expert_bias.clone() for i, m in layers.items() if not m.hashed}
    table = layers[0].tid2eid.clone()
    # Each layer's input, to choose its experts again here, as the published rule reads.
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda mod, inputs, i=i: seen.__setitem__(i, inputs))
             for i, m in layers.items()]
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen)
    balance = MoEBalance([model], moe, args, ONE_PROCESS, microbatches_per_step=1)
    # Activation checkpointing runs the forward again in backward: the tokens are counted once.
    logits = checkpoint(model, tokens[:, :-1], use_reentrant=False)
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        model(tokens[:, :-1])  # evaluation counts nothing
    expected = {}
    for i, m in layers.items():
        x, ids = seen[i]
        if m.hashed:
            chosen = table[ids.reshape(-1)]
        else:
            scores = F.softplus(m.router(x.reshape(-1, args.dim))).sqrt()
            chosen = torch.topk(scores + before[i], args.moe.top_k, dim=-1).indices
        expected[i] = torch.bincount(chosen.reshape(-1), minlength=args.moe.num_experts).float()
        assert expected[i].sum() == 2 * SEQ * args.moe.top_k
    load = balance.after_step()
    assert load.keys() == expected.keys()
    for i, m in layers.items():
        assert torch.equal(load[i], expected[i]), (i, load[i], expected[i])
        assert m.tokens_per_expert.sum() == 0  # the next step counts afresh
        if m.hashed:
            assert torch.equal(m.tid2eid, table)
            continue
        step = torch.sign(expected[i].mean() - expected[i]) * COEFF
        assert step.abs().sum() > 0  # the layer's load is uneven: its bias moves
        assert torch.equal(m.expert_bias, before[i] + step), (i, m.expert_bias - before[i], step)


def test_the_moved_bias_is_resumed_from_dcp_and_exported_as_the_hubs_name(tmp_path):
    from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint
    from titanctl.train.trainer import Trainer

    def run(out):
        trainer = Trainer(load_config(RECIPE, [
            "--moe.load_balance_coeff", str(COEFF), "--training.steps", "2", "--training.seq_len", str(SEQ),
            "--training.local_batch_size", "1", "--checkpoint.enable_checkpoint", "true",
            "--checkpoint.interval", "1", "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1",
            "--job.dump_folder", str(out)]))
        trainer.train()
        rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows}, {
            k: b.clone() for k, b in trainer.model_parts[0].named_buffers() if k.endswith("expert_bias")}

    whole, biases = run(tmp_path / "whole")
    assert sorted(biases) == [f"layers.{i}.mlp.expert_bias" for i in (1, 2, 3)]  # not the hash-routed layer 0
    first, _ = load_checkpoint(tmp_path / "whole" / "checkpoint" / "step-1")
    assert "layers.0.mlp.tid2eid" in first and "layers.0.mlp.expert_bias" not in first
    for name, bias in biases.items():
        moved = first[name] / COEFF  # one step from zero: each expert's by +-coeff, or 0 at the mean
        assert torch.equal(moved, moved.round()) and moved.abs().max() == 1, (name, first[name])
        assert not torch.equal(bias, first[name]), name  # the second step moved it again
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "whole" / "checkpoint" / "step-1", tmp_path / "resumed" / "checkpoint" / "step-1")
    resumed, resumed_biases = run(tmp_path / "resumed")
    assert resumed == {2: whole[2]}
    assert all(torch.equal(resumed_biases[k], b) for k, b in biases.items())
    convert_checkpoint(tmp_path / "whole" / "checkpoint" / "step-2", tmp_path / "hf", dst_format="hf")
    exported = {k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    assert "model.layers.0.ffn.gate.bias" not in exported and "model.layers.0.ffn.gate.tid2eid" in exported
    for i in (1, 2, 3):
        assert torch.equal(exported[f"model.layers.{i}.ffn.gate.bias"], biases[f"layers.{i}.mlp.expert_bias"]), i

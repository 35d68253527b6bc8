"""Tokens/s of a training step of the debug model with model.attn_mask_type = block_causal
relative to causal, on CPU.

Each contender is the step ``titanctl train`` runs (built from the recipe: its compile and kernel
settings; ``ForwardBackward``, so block_causal includes building the mask from the tokens every
step), plus gradient clipping and the optimizer. Same batch for both: random tokens with a BOS
every ``--doc-len`` tokens on average. On CPU block_causal runs the same SDPA kernel with a dense
(B, 1, T, T) bool mask, so its cost does not depend on where the documents start. The contenders
run in alternating rounds, so that load from other processes hits both alike; the ratio printed
is the median of the rounds' ratios. The first step of each (compile, warm-up) is timed apart.

    PYTHONPATH=. .venv/bin/python benchmarks/attention_mask_speed.py [--rounds 5] [--seq-len 256]
        [--batch 8] [--doc-len 64] [--compile | --no-compile] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch
from train_throughput import alternating_rates  # this folder is on sys.path when run as a script

from titanctl.config.recipe import load_config
from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from titanctl.models.registry import model_args_from_config
from titanctl.parallel.layouts.build import build_model_parts
from titanctl.parallel.layouts.dims import ParallelDims
from titanctl.train.optim import build_optimizer
from titanctl.train.step import ForwardBackward

REPO = Path(__file__).resolve().parents[1]
MASK_TYPES = ("causal", "block_causal")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes/llama3_debug.toml"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--doc-len", type=int, default=64, help="mean document length in tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="compile.enable on/off (default: the recipe's)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)

    overrides = ["--training.local_batch_size", str(opts.batch), "--training.seq_len", str(opts.seq_len),
                 "--training.mixed_precision_param", "float32", "--parallelism.data_parallel_shard_degree", "1",
                 "--activation_checkpoint.mode", "none"]
    if opts.compile is not None:
        overrides += ["--compile.enable", str(opts.compile).lower()]
    tokenizer = Tokenizer(load_config(opts.recipe, overrides).model.tokenizer_path or DEFAULT_TOKENIZER_PATH)
    cpu = torch.device("cpu")

    torch.manual_seed(0)
    tokens = torch.randint(0, tokenizer.vocab_size, (opts.batch, opts.seq_len + 1))
    tokens[tokens == tokenizer.bos_id] = 0
    tokens[torch.rand(tokens.shape) < 1 / opts.doc_len] = tokenizer.bos_id
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def make_step(mask_type: str):
        cfg = load_config(opts.recipe, [*overrides, "--model.attn_mask_type", mask_type])
        dims = ParallelDims.from_config(cfg.parallelism, 1)
        args = model_args_from_config(cfg.model, tokenizer.vocab_size, opts.seq_len)
        model = build_model_parts(cfg, dims, args, cpu).parts[0]
        forward_backward = ForwardBackward(cfg, dims, [model], None, cpu, bos_id=tokenizer.bos_id)
        optimizer = build_optimizer([model], cfg.optimizer)

        def step():
            forward_backward([(inputs, labels)])
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step, cfg

    steps, cfgs = {}, {}
    for mask_type in MASK_TYPES:
        steps[mask_type], cfgs[mask_type] = make_step(mask_type)
    first, rates = alternating_rates(steps, opts.batch * opts.seq_len, opts.rounds, opts.steps_per_round)

    cfg = cfgs["causal"]
    print(f"{os.cpu_count()} cores, {torch.get_num_threads()} threads; model {cfg.model.flavor}, batch "
          f"{opts.batch} x {opts.seq_len}, fp32, compile {'on' if cfg.compile.enable else 'off'}, "
          f"{(inputs == tokenizer.bos_id).sum().item() / opts.batch:.1f} documents started per window")
    for name in steps:
        print(f"{name:14s}{statistics.median(rates[name]):10,.0f} tokens/s   first step {first[name]:6.2f} s "
              f"(rounds: {', '.join(f'{r:,.0f}' for r in rates[name])})")
    ratio = statistics.median(b / c for b, c in zip(rates["block_causal"], rates["causal"]))
    print(f"ratio block_causal/causal = {ratio:.3f}")


if __name__ == "__main__":
    main()

"""Step time and activation memory of the debug model's training step with model.attn_mask_type =
block_causal (span attention, and the dense mask route it replaced) relative to causal, on CPU.

Each contender is the step ``titanctl train`` runs (built from the recipe: its compile and kernel
settings; ``ForwardBackward``, so block_causal includes building the mask from the tokens every
step), plus gradient clipping and the optimizer:

- ``causal``: no mask, SDPA's causal kernel;
- ``block_causal``: a ``SpanMask`` (the documents' starts): ``span_attention`` attends each chunk of
  queries to the keys its rows see, so its work follows the mask's area;
- ``dense``: the route before it: the same mask as a dense (B, 1, T, T) bool, SDPA under it (its CPU
  kernel keeps a float copy for backward), every (query, key) pair computed.

Same batch for all: random tokens with a BOS every ``--doc-len`` tokens on average (geometric document
lengths). Time: the contenders run in alternating rounds, so that load from other processes hits them
alike; each ratio printed is the median of the rounds' ratios. Activation memory: the bytes of the
distinct storages autograd keeps for backward (saved-tensor hooks) over one forward, which is where an
S x S mask or its float copy shows. The first step of each (compile, warm-up) is timed apart.

    PYTHONPATH=. .venv/bin/python benchmarks/attention_mask_speed.py [--seq-len 2048 4096 8192 16384]
        [--rounds 3] [--batch 1] [--doc-len 2048] [--contenders causal block_causal dense]
        [--compile | --no-compile] [--threads N]
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
CONTENDERS = ("causal", "block_causal", "dense")


class DenseMasks:
    """The step's masks (``MicrobatchMasks``) handed to the model as dense bools: the route span attention
    replaced."""

    def __init__(self, masks):
        self.masks = masks

    def __call__(self, *args, **kwargs):
        mask = self.masks(*args, **kwargs)
        return None if mask is None else mask.dense()

    def __getattr__(self, name):
        return getattr(self.masks, name)


def saved_bytes(run) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``run`` (a forward) runs."""
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes/llama3_debug.toml"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, nargs="+", default=[2048])
    parser.add_argument("--doc-len", type=int, default=2048, help="mean document length in tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-per-round", type=int, default=1)
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="compile.enable on/off (default: the recipe's)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    for seq_len in opts.seq_len:
        measure(opts, seq_len)


def measure(opts, seq_len: int) -> None:
    overrides = ["--training.local_batch_size", str(opts.batch), "--training.seq_len", str(seq_len),
                 "--training.mixed_precision_param", "float32", "--parallelism.data_parallel_shard_degree", "1",
                 "--activation_checkpoint.mode", "none"]
    if opts.compile is not None:
        overrides += ["--compile.enable", str(opts.compile).lower()]
    tokenizer = Tokenizer(load_config(opts.recipe, overrides).model.tokenizer_path or DEFAULT_TOKENIZER_PATH)
    cpu = torch.device("cpu")

    torch.manual_seed(0)
    tokens = torch.randint(0, tokenizer.vocab_size, (opts.batch, seq_len + 1))
    tokens[tokens == tokenizer.bos_id] = 0
    tokens[torch.rand(tokens.shape) < 1 / opts.doc_len] = tokenizer.bos_id
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def make_step(contender: str):
        mask_type = "causal" if contender == "causal" else "block_causal"
        cfg = load_config(opts.recipe, [*overrides, "--model.attn_mask_type", mask_type])
        dims = ParallelDims.from_config(cfg.parallelism, 1)
        args = model_args_from_config(cfg.model, tokenizer.vocab_size, seq_len)
        torch.manual_seed(0)
        model = build_model_parts(cfg, dims, args, cpu).parts[0]
        forward_backward = ForwardBackward(cfg, dims, [model], None, cpu, bos_id=tokenizer.bos_id)
        if contender == "dense":
            forward_backward.attn_masks = DenseMasks(forward_backward.attn_masks)
        optimizer = build_optimizer([model], cfg.optimizer)

        def step():
            forward_backward([(inputs, labels)])
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def forward():
            mask = forward_backward.attn_masks(inputs)
            model(inputs, **({} if mask is None else {"attn_mask": mask}))

        return step, forward, cfg

    steps, activations, cfg = {}, {}, None
    for contender in opts.contenders:
        steps[contender], forward, cfg = make_step(contender)
        activations[contender] = saved_bytes(forward)
    first, rates = alternating_rates(steps, opts.batch * seq_len, opts.rounds, opts.steps_per_round)

    documents = (inputs == tokenizer.bos_id).sum().item() / opts.batch
    print(f"\n{os.cpu_count()} cores, {torch.get_num_threads()} threads; model {cfg.model.flavor}, batch "
          f"{opts.batch} x {seq_len}, fp32, compile {'on' if cfg.compile.enable else 'off'}, "
          f"{documents:.1f} documents started per window (mean length {opts.doc_len})")
    for name in steps:
        seconds = [opts.batch * seq_len / r for r in rates[name]]
        print(f"{name:14s}{statistics.median(seconds):9.3f} s a step   activations {activations[name] / 2**20:10.1f} "
              f"MiB   first step {first[name]:7.2f} s")
    for a, b in (("block_causal", "dense"), ("block_causal", "causal"), ("dense", "causal")):
        if a in steps and b in steps:
            ratio = statistics.median(rb / ra for ra, rb in zip(rates[a], rates[b]))
            print(f"ratio {a}/{b}: step time {ratio:.3f}, activations {activations[a] / activations[b]:.3f}")


if __name__ == "__main__":
    main()

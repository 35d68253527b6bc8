"""Tokens/s of titanctl's training step vs. a plain transformers LlamaForCausalLM step.

Same model shape, batch, optimizer and machine; both in fp32 eager unless --dtype bfloat16
(autocast for both). Prints both rates and their ratio. ``--float8`` and ``--norm fused_rmsnorm``
add titanctl variants (float8 linears; the fused norm), each printed as a ratio to plain titanctl.
On a CPU float8 is emulated: its ratio shows the emulation's overhead, not a speed-up.

    .venv/bin/python benchmarks/train_throughput.py [--rounds 5] [--flavor debugmodel] [--seq-len 256]
        [--float8] [--norm fused_rmsnorm]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from titanctl.checkpoint.hf_names import hf_config, to_hf_state_dict
from titanctl.config.job_config import Float8, LRScheduler
from titanctl.config.job_config import Optimizer as OptimizerConfig
from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from titanctl.models.llama import LLAMA3_FLAVORS, Transformer
from titanctl.models.llama.shapes import num_params
from titanctl.parallel.init import initialize_weights
from titanctl.train.loss import cross_entropy_loss
from titanctl.train.lr_schedule import build_lr_scheduler
from titanctl.train.optim import build_optimizer


def alternating_rates(steps: dict, batch_tokens: int, rounds: int, steps_per_round: int) -> dict[str, float]:
    """Median tokens/s of each step function, measured in alternating rounds so that load from
    other processes on the machine affects both alike."""
    for step in steps.values():  # warm up
        step()
        step()
    rates: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(steps_per_round):
                step()
            rates[name].append(steps_per_round * batch_tokens / (time.perf_counter() - start))
    return {name: statistics.median(r) for name, r in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--float8", action="store_true", help="also time titanctl with float8 linears")
    parser.add_argument("--norm", default="rmsnorm", choices=["rmsnorm", "fused_rmsnorm"],
                        help="fused_rmsnorm: also time titanctl with the fused norm")
    opts = parser.parse_args()

    if opts.float8:
        from titanctl.parallel.float8 import torchao_float8

        torchao_float8()  # before transformers imports torchao with its import-time warnings
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab = Tokenizer(DEFAULT_TOKENIZER_PATH).vocab_size
    args = LLAMA3_FLAVORS[opts.flavor].replace(vocab_size=vocab, max_seq_len=opts.seq_len)
    ours = Transformer(args)
    initialize_weights(ours, seed=0)
    theirs = LlamaForCausalLM(LlamaConfig(**hf_config(args)))
    theirs.load_state_dict(to_hf_state_dict(ours.state_dict(), args))

    tokens = torch.randint(0, vocab, (opts.batch, opts.seq_len + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    dtype = getattr(torch, opts.dtype)
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)

    def make_step(model, forward):
        optimizer = build_optimizer([model], OptimizerConfig())
        scheduler = build_lr_scheduler(optimizer, LRScheduler(warmup_steps=2), total_steps=1000)

        def step():
            with autocast:
                loss = cross_entropy_loss(forward(model), labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    steps = {
        "titanctl": make_step(ours, lambda m: m(inputs)),
        "transformers": make_step(theirs, lambda m: m(input_ids=inputs).logits),
    }
    if opts.float8:
        from titanctl.parallel.float8 import convert_to_float8

        float8 = variant(ours, args)
        convert_to_float8(float8, Float8(), tp=1, device=torch.device("cpu"))
        steps["titanctl+float8"] = make_step(float8, lambda m: m(inputs))
    if opts.norm == "fused_rmsnorm":
        steps["titanctl+fused_rmsnorm"] = make_step(variant(ours, args.replace(norm_type="fused_rmsnorm")),
                                                    lambda m: m(inputs))

    batch_tokens = opts.batch * opts.seq_len
    rates = alternating_rates(steps, batch_tokens, opts.rounds, opts.steps_per_round)
    ours_tps, theirs_tps = rates["titanctl"], rates["transformers"]
    print(f"model {opts.flavor} ({num_params(args) / 1e6:.1f}M params), batch {opts.batch} x {opts.seq_len}, "
          f"{opts.dtype}, {torch.get_num_threads()} threads")
    for name, rate in rates.items():
        print(f"{name:24s}{rate:10,.0f} tokens/s")
    print(f"ratio titanctl/transformers = {ours_tps / theirs_tps:.3f}")
    for name in rates:
        if name.startswith("titanctl+"):
            print(f"ratio {name}/titanctl = {rates[name] / ours_tps:.3f}")


def variant(model: Transformer, args) -> Transformer:
    """A copy of ``model`` (same weights) built from ``args``."""
    copy = Transformer(args)
    copy.load_state_dict(model.state_dict())
    return copy


if __name__ == "__main__":
    main()

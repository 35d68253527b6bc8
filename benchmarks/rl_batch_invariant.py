"""The cost of rl.batch_invariant: its kernels against torch's, and a whole RL step, with ratios.

Kernels at the shapes of the GRPO recipe (recipes/llama3_debug_grpo.toml) on the debug Llama: decode is 128
completions x 1 token, training a microbatch of 32 completions x 28 tokens; the feed-forward linear (in 256 ->
out 768), attention over the 64-position KV cache with grouped-query heads (8 query, 2 key/value heads of 32),
silu. End to end: steps of ``titanctl rl``'s loop (rollout + update) on the
shipped task's prompts with the debug model, default kernels against batch-invariant ones. The two sides
run in alternation, so a busy machine slows both alike; each figure is the median of its repetitions.

Usage: PYTHONPATH=. .venv/bin/python benchmarks/rl_batch_invariant.py [--steps 6] [--layers 6] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from titanctl.rl import batch_invariant as bi


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def alternating(a, b, rounds: int, repeats: int) -> tuple[float, float]:
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(timed(a, repeats))
        tb.append(timed(b, repeats))
    return statistics.median(ta), statistics.median(tb)


def kernels(rounds: int) -> list[tuple[str, float, float]]:
    torch.manual_seed(0)
    weight = torch.randn(768, 256)
    decode, batch, tokens, cache = 128, 32, 28, 64
    rows = []
    for name, m in ((f"linear, decode ({decode} rows)", decode), (f"linear, training ({batch * tokens} rows)",
                                                                     batch * tokens)):
        x = torch.randn(m, 256)
        rows.append((name, *alternating(lambda x=x: F.linear(x, weight), lambda x=x: bi.linear(x, weight), rounds, 50)))
    q, k, v = torch.randn(decode, 8, 1, 32), torch.randn(decode, 2, cache, 32), torch.randn(decode, 2, cache, 32)
    mask = torch.arange(cache)[None, None, None, :] <= torch.randint(10, cache, (decode, 1, 1, 1))
    rows.append((f"attention, decode ({decode} x 8 heads)", *alternating(
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
        lambda: bi.attention(q, k, v, attn_mask=mask, enable_gqa=True, key_length=cache), rounds, 20)))
    q, k, v = (torch.randn(batch, 8, tokens, 32), torch.randn(batch, 2, tokens, 32),
               torch.randn(batch, 2, tokens, 32))
    rows.append((f"attention, training ({batch} x {tokens} tokens)", *alternating(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        lambda: bi.attention(q, k, v, is_causal=True, enable_gqa=True, key_length=cache), rounds, 20)))
    h = torch.randn(batch * tokens, 768)
    rows.append((f"silu ({batch * tokens} x 768)", *alternating(lambda: F.silu(h), lambda: bi.silu(h), rounds, 50)))
    return rows


def rl_steps(steps: int, layers: int, invariant: bool, folder: str) -> float:
    """Seconds per step of the RL loop (after one warm-up step), from a fresh model."""
    from titanctl.config.recipe import load_config
    from titanctl.rl.loop import RLTrainer

    cfg = load_config("recipes/llama3_debug_grpo.toml", [
        "--model.n_layers", str(layers), "--training.steps", str(steps + 1), "--checkpoint.enable_checkpoint", "false",
        "--checkpoint.initial_load_path", "", "--metrics.enable_tensorboard", "false", "--job.dump_folder", folder,
        "--rl.batch_invariant", str(invariant).lower(), "--metrics.log_freq", "1000"])
    trainer = RLTrainer(cfg)
    times = []
    original = trainer.update

    def timed_update(batch):
        out = original(batch)
        times.append(time.perf_counter())
        return out

    trainer.update = timed_update
    trainer.console.quiet = True
    trainer.train()
    return (times[-1] - times[0]) / (len(times) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'kernel':40s} {'torch ms':>9s} {'invariant ms':>13s} {'ratio':>7s}")
    for name, base, inv in kernels(args.rounds):
        print(f"{name:40s} {base * 1e3:9.3f} {inv * 1e3:13.3f} {inv / base:6.2f}x")
    base, inv = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(2):  # alternating whole runs
            base.append(rl_steps(args.steps, args.layers, False, f"{tmp}/default{r}"))
            inv.append(rl_steps(args.steps, args.layers, True, f"{tmp}/invariant{r}"))
    b, i = statistics.median(base), statistics.median(inv)
    print(f"{'RL step, end to end (' + str(args.layers) + ' layers)':40s} {b * 1e3:9.1f} {i * 1e3:13.1f} {i / b:6.2f}x")


if __name__ == "__main__":
    main()

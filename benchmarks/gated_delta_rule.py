"""titanctl's chunked gated delta rule against transformers' ``torch_chunk_gated_delta_rule`` on CPU, forward +
backward, the same inputs: the ratio of their times (goal: titanctl >= 1.5x).

Both are plain torch with chunks of 64 (transformers' is the fallback its Qwen3.5 and Qwen3-Next run without
flash-linear-attention, hence on every CPU). Shapes: Qwen3.5-35B-A3B's Gated DeltaNet heads (32 value heads of
128, keys of 128; --heads to change), batch 1, sequence 2048, fp32. transformers scales q by d_k^-1/2 itself,
titanctl's caller does: titanctl gets q already scaled, so both compute the same rule (the outputs are checked
equal before timing). Each time is the best of several rounds, the two kernels taking turns in each (the least
disturbed by other processes); run it on an idle machine for a figure to quote.

    PYTHONPATH=. .venv/bin/python benchmarks/gated_delta_rule.py [--seq 2048] [--heads 32] [--threads N]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from titanctl.models.common.gated_delta_rule import chunk_gated_delta_rule


def interleaved_best(fns: dict, repeats: int) -> dict[str, float]:
    """The best time of each callable over ``repeats`` rounds, one call of each per round: a load that comes and
    goes slows both alike, so the ratio holds better than with one kernel's repeats after the other's."""
    for fn in fns.values():
        fn()  # warm-up: allocator, thread pool
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def inputs(batch: int, seq: int, heads: int, dk: int, dv: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(batch, seq, heads, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(batch, seq, heads, dk, generator=gen), dim=-1)
    v = torch.randn(batch, seq, heads, dv, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(batch, seq, heads, generator=gen))  # log decay <= 0
    beta = torch.sigmoid(torch.randn(batch, seq, heads, generator=gen))
    return [q, k, v, g, beta]


def main() -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32, help="value heads (each with its own key head here)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    print(f"CPU {cpu}, {torch.get_num_threads()} threads, load average "
          f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])}, torch {torch.__version__}")
    dk = dv = opts.head_dim
    base = inputs(opts.batch, opts.seq, opts.heads, dk, dv)
    scale = dk**-0.5

    def ours(q, k, v, g, beta):
        return chunk_gated_delta_rule(q * scale, k, v, g, beta)[0]

    def theirs(q, k, v, g, beta):
        return torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64)[0]

    with torch.no_grad():
        delta = (ours(*base) - theirs(*base)).abs().max().item()
    print(f"shape: batch {opts.batch}, seq {opts.seq}, {opts.heads} heads, d_k = d_v = {dk}, fp32; "
          f"max |Δ output| {delta:.2e}")

    def step(kernel):
        leaves = [t.clone().requires_grad_() for t in base]
        out = kernel(*leaves)
        out.backward(torch.ones_like(out))  # a contiguous upstream gradient, as a loss's
        return leaves

    names = {"titanctl chunk_gated_delta_rule": ours, "transformers torch_chunk_gated_delta_rule": theirs}
    with torch.no_grad():
        forward = interleaved_best({name: lambda k=kernel: k(*base) for name, kernel in names.items()}, opts.repeats)
    both = interleaved_best({name: lambda k=kernel: step(k) for name, kernel in names.items()}, opts.repeats)
    for name in names:
        print(f"{name:44s} forward {forward[name] * 1e3:8.1f} ms   forward + backward {both[name] * 1e3:8.1f} ms")
    (f_ours, f_theirs), (b_ours, b_theirs) = forward.values(), both.values()
    grads = [step(ours), step(theirs)]
    worst = max((a.grad - b.grad).abs().max().item() for a, b in zip(*grads, strict=True))
    print(f"max |Δ gradient| {worst:.2e}")
    print(f"ratio (transformers / titanctl): forward {f_theirs / f_ours:.2f}x, forward + backward "
          f"{b_theirs / b_ours:.2f}x (goal >= 1.5x)")


if __name__ == "__main__":
    main()

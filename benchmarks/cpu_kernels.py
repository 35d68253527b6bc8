"""The CPU kernel choices behind titanctl's training step, measured on this machine.

1. fp32 linear products: torch's matmul (MKL) vs oneDNN (titanctl's ``training.cpu_linear``), in
   GFLOP/s, for the forward, input-gradient and weight-gradient products of every linear shape of
   the model (debug model, batch 8 x 256 by default).
2. Causal grouped-query flash attention, forward + backward, in fp32 and bf16, for head sizes 16 to
   128 at the same model width: below model.CPU_FP32_ATTENTION_BELOW_HEAD_DIM titanctl runs bf16
   attention in fp32 on CPU; and K/V repeated to every head (as titanctl did) vs SDPA's enable_gqa.
3. One block of the masked ring and of span attention (``softmax_blocks``: the fused kernel with its
   log-sum-exp), 2048 x 2048, 8 heads of 32, fp32: a causal triangle under an additive mask vs as causal,
   and a block seen whole under an all-zero mask vs none, forward and backward.

Each figure is the best of several repeats (the least disturbed by other processes).

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_kernels.py [--threads N] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from titanctl.data.tokenizer import Tokenizer
from titanctl.models.llama.args import LLAMA3_FLAVORS
from titanctl.parallel.converters.onednn_linear import onednn_mm_t


def best_seconds(fn, repeats: int = 5, calls: int = 4) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def linear_shapes(flavor: str) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of each distinct linear of a block and the output layer."""
    args = LLAMA3_FLAVORS[flavor].replace(vocab_size=Tokenizer().vocab_size)
    kv = args.kv_heads * args.head_dim
    return [("wq, wo", args.dim, args.dim), ("wk, wv", args.dim, kv), ("w1, w3", args.dim, args.ffn_hidden_dim),
            ("w2", args.ffn_hidden_dim, args.dim), ("output", args.dim, args.vocab_size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--tokens", type=int, default=2048, help="rows of the activations (batch x seq)")
    parser.add_argument("--threads", type=int, default=0)
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    print(f"CPU {cpu}, {torch.get_num_threads()} threads, load average "
          f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])}")

    print(f"\nfp32 linear products, {opts.tokens} rows: GFLOP/s of torch's matmul (MKL) / oneDNN")
    for name, k, n in linear_shapes(opts.flavor):
        rates = linear_gflops(opts.tokens, k, n)
        cells = [f"{product} {aten:5.0f} / {onednn:5.0f}" for product, (aten, onednn) in rates]
        print(f"  {name:8s} {k:>5} -> {n:<5}  " + "   ".join(cells))

    print("\ncausal GQA flash attention (4 query heads per K/V head), batch 8 x 256, width 256: "
          "forward + backward ms, fp32 / bf16")
    for head_dim in (16, 32, 64, 128):
        fp32, bf16 = attention_ms(head_dim, torch.float32), attention_ms(head_dim, torch.bfloat16)
        print(f"  head_dim {head_dim:>3} ({256 // head_dim:>2} heads): {fp32:6.1f} / {bf16:6.1f}   "
              f"bf16/fp32 time {bf16 / fp32:.2f}")
    repeated = attention_ms(16, torch.float32, repeat_kv=True)
    gqa = attention_ms(16, torch.float32)
    print(f"  head_dim 16, fp32: K/V repeated to every head first {repeated:.1f} ms, enable_gqa {gqa:.1f} ms")

    print("\none block of the fused kernel with log-sum-exp, 2048 x 2048, 8 heads of 32, fp32: ms masked / "
          "unmasked (causal: is_causal; whole: no mask)")
    for name, (masked, plain) in block_ms().items():
        print(f"  {name:16s} {masked:6.1f} / {plain:6.1f}   masked/unmasked time {masked / plain:.2f}")


def linear_gflops(t: int, k: int, n: int) -> list[tuple[str, tuple[float, float]]]:
    """GFLOP/s of torch's matmul and of oneDNN for y = x W^T, dx = dy W and dW = dy^T x."""
    x, w, g = torch.randn(t, k), torch.randn(n, k), torch.randn(t, n)
    if n > k:  # as titanctl's backward does it: oneDNN copies the narrower transposed operand
        def onednn_weight_grad():
            return onednn_mm_t(x.t(), g.t()).t().contiguous()
    else:
        def onednn_weight_grad():
            return onednn_mm_t(g.t(), x.t())
    products = {
        "forward": (lambda: x @ w.t(), lambda: onednn_mm_t(x, w)),
        "input grad": (lambda: g @ w, lambda: onednn_mm_t(g, w.t())),
        "weight grad": (lambda: g.t() @ x, onednn_weight_grad),
    }
    flops = 2 * t * k * n / 1e9
    return [(name, (flops / best_seconds(aten), flops / best_seconds(onednn)))
            for name, (aten, onednn) in products.items()]


def attention_ms(head_dim: int, dtype: torch.dtype, repeat_kv: bool = False) -> float:
    """Milliseconds of causal GQA flash attention forward + backward at model width 256
    (``repeat_kv``: K and V copied to every query head first, instead of enable_gqa)."""
    heads = 256 // head_dim
    kv_heads = max(1, heads // 4)
    q = torch.randn(8, heads, 256, head_dim, dtype=dtype, requires_grad=True)
    k = torch.randn(8, kv_heads, 256, head_dim, dtype=dtype, requires_grad=True)
    v = torch.randn(8, kv_heads, 256, head_dim, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(q)

    def step():
        keys, values = k, v
        if repeat_kv:
            keys, values = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=keys.shape[1] != heads)
        out.backward(grad)

    return 1e3 * best_seconds(step, repeats=4, calls=2)


def block_ms(size: int = 2048) -> dict[str, tuple[float, float]]:
    """Milliseconds of one block (``softmax_blocks``' fused calls), under its additive mask and as
    ``_fused_mask`` runs it: the causal triangle as causal, a block seen whole without a mask."""
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    q, k, v = (torch.randn(1, 8, size, 32) for _ in range(3))
    grad = torch.randn_like(q)
    triangle = torch.zeros(size, size).masked_fill(torch.ones(size, size, dtype=torch.bool).triu(1), float("-inf"))
    out, lse = forward(q, k, v, 0.0, True)
    times = {}
    for name, mask, causal in (("causal", triangle, True), ("whole", torch.zeros(size, size), False)):
        mask = mask[None, None]
        times[f"{name} forward"] = (1e3 * best_seconds(lambda m=mask: forward(q, k, v, 0.0, False, attn_mask=m)),
                                    1e3 * best_seconds(lambda c=causal: forward(q, k, v, 0.0, c)))
        times[f"{name} backward"] = (
            1e3 * best_seconds(lambda m=mask: backward(grad, q, k, v, out, lse, 0.0, False, attn_mask=m, scale=None)),
            1e3 * best_seconds(lambda c=causal: backward(grad, q, k, v, out, lse, 0.0, c, scale=None)))
    return times


if __name__ == "__main__":
    main()

"""Tokens/s of titanctl's training step vs. a plain transformers step (the family's ``*ForCausalLM``).

titanctl's step is built as ``titanctl train`` builds it from a recipe (default the debug recipe:
its compile and linear-kernel settings, model converters, loss and optimizer); the peer is the
family's transformers class (``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``:
transformers loops over a MoE layer's experts; ``Qwen3_5MoeForCausalLM`` with --recipe
recipes/qwen3_5_moe_debug.toml, its experts loaded packed as it holds them) in eager mode with torch's
AdamW. Same model shape,
same weights (titanctl's initialization copied into transformers), same batch, same optimizer
settings, same machine and threads. ``--dtype float32`` (default) runs both in fp32;
``--dtype bfloat16`` both under bf16 autocast, and only on a CPU with bf16 units (``avx512_bf16``
or ``amx_bf16``, read from /proc/cpuinfo at run time). The contenders run in alternating rounds, so that load from other
processes hits both alike; the ratio printed is the median of the rounds' ratios.

The first step of each contender is timed apart (for titanctl with compile on, it includes
torch.compile) and left out of tokens/s, as ``titanctl train`` leaves it out of its tps.

``--isa both`` (the default) runs the whole comparison twice in subprocesses: with the kernels this CPU
picks (native) and as on an AVX2-only CPU (``ISA_ENV["avx2"]``: torch's vectorized kernels and inductor's
generated code at AVX2 width, oneDNN and MKL capped at AVX2), and prints both ratios; on a CPU without
AVX-512 the two are the same and only native runs. ``--isa native`` / ``avx2`` run one.

Last, a floor: the step's linear FLOPs at the fastest product rate this CPU reaches on the model's shapes
(MKL or oneDNN) plus torch's attention kernel as measured; transformers' step over it is the most any
step on torch's kernels could gain here.

``--float8`` and ``--norm fused_rmsnorm`` add titanctl variants (float8 linears; the fused norm),
each printed as a ratio to plain titanctl. On a CPU float8 is emulated: its ratio shows the
emulation's overhead, not a speed-up.

    PYTHONPATH=. .venv/bin/python benchmarks/train_throughput.py [--isa both|native|avx2] [--rounds 5]
        [--dtype bfloat16] [--compile | --no-compile] [--linear auto|onednn|aten] [--threads N]
        [--seq-len 256] [--batch 8]
        [--recipe recipes/llama3_debug.toml] [--float8] [--norm fused_rmsnorm]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from titanctl.checkpoint.hf.names import hf_config, to_hf_state_dict
from titanctl.config.recipe import load_config
from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from titanctl.models.registry import model_args_from_config
from titanctl.models.shapes import num_params
from titanctl.parallel.converters.onednn_linear import linear_kernel
from titanctl.parallel.layouts.build import build_model_parts
from titanctl.parallel.layouts.dims import ParallelDims
from titanctl.train.loss import build_loss_fn, cross_entropy_loss
from titanctl.train.lr_schedule import build_lr_scheduler
from titanctl.train.optim import build_optimizer

REPO = Path(__file__).resolve().parents[1]
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# What an AVX2-only CPU runs, on a CPU with AVX-512: read by torch, oneDNN and MKL when they load, and by
# inductor when it picks its vector width (ATEN_CPU_CAPABILITY), so set before torch is imported.
ISA_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


def has_avx512() -> bool:
    try:
        return "avx512f" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def run_per_isa(argv: list[str]) -> None:
    """This benchmark once per ISA in a subprocess (the ISA is fixed when torch loads); prints each
    run's output and then the ratios side by side."""
    isas = ["native", "avx2"] if has_avx512() else ["native"]
    ratios = {}
    for isa in isas:
        settings = " ".join(f"{key}={value}" for key, value in ISA_ENV.get(isa, {}).items())
        print(f"--- {isa}" + (f" ({settings})" if settings else ""), flush=True)
        # Without this process's TORCHINDUCTOR_CACHE_DIR (importing inductor sets it): torch 2.13's cache does
        # not tell kernels of one capability from another's, and titanctl's import gives each its own folder.
        inherited = {k: v for k, v in os.environ.items()
                     if k not in ("TORCHINDUCTOR_CACHE_DIR", *ISA_ENV["avx2"])}
        env = {**inherited, **ISA_ENV.get(isa, {}), "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, __file__, *argv, "--isa", isa], env=env, text=True,
                             capture_output=True, check=True).stdout
        print(out, end="", flush=True)
        ratios[isa] = re.search(r"ratio titanctl/transformers = ([0-9.]+)", out).group(1)
    if len(isas) == 1:
        print("(no AVX-512 on this CPU: native is the AVX2 path)")
    print("titanctl/transformers: " + ", ".join(f"{isa} {ratio}" for isa, ratio in ratios.items()))


def cpu_description() -> tuple[str, list[str]]:
    """The CPU's model name and which bf16 units its flags list (empty: none)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())  # the first CPU's
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    return fields.get("model name") or platform.processor() or "unknown CPU", [f for f in BF16_FLAGS if f in flags]


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def alternating_rates(steps: dict, batch_tokens: int, rounds: int, steps_per_round: int):
    """First-step seconds of each step function, then tokens/s per round measured in alternating
    rounds (after one more warm-up step each)."""
    first = {}
    for name, step in steps.items():
        start = time.perf_counter()
        step()
        first[name] = time.perf_counter() - start
        step()
    rates: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(steps_per_round):
                step()
            rates[name].append(steps_per_round * batch_tokens / (time.perf_counter() - start))
    return first, rates


def best_gemm_rate(model: torch.nn.Module, tokens: int) -> float:
    """FLOP/s of this CPU's fastest fp32 product (MKL through torch, or oneDNN) over the model's
    linear shapes at ``tokens`` rows: forward, input-gradient and weight-gradient forms."""
    onednn = torch.ops.titanctl.onednn_mm_t if hasattr(torch.ops, "titanctl") else None
    best = 0.0
    for n, k in {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}:
        x, w, dy = torch.randn(tokens, k), torch.randn(n, k), torch.randn(tokens, n)
        products = [(torch.mm, x, w.t()), (torch.mm, dy, w), (torch.mm, dy.t(), x)]
        if onednn is not None:
            products += [(onednn, x, w), (onednn, dy, w.t())]
        for product, a, b in products:
            product(a, b)
            start = time.perf_counter()
            for _ in range(5):
                product(a, b)
            best = max(best, 5 * 2 * tokens * n * k / (time.perf_counter() - start))
    return best


def attention_seconds(args, batch: int, seq_len: int) -> float:
    """Seconds of torch's causal attention kernel (forward and backward) over all layers at the model's
    shapes: titanctl and transformers both call it."""
    head_dim = args.dim // args.n_heads
    q = torch.randn(batch, args.n_heads, seq_len, head_dim, requires_grad=True)
    kv = [torch.randn(batch, args.n_kv_heads, seq_len, head_dim, requires_grad=True) for _ in range(2)]

    def layer():
        torch.nn.functional.scaled_dot_product_attention(q, *kv, is_causal=True, enable_gqa=True).sum().backward()

    layer()
    start = time.perf_counter()
    for _ in range(3):
        layer()
    return (time.perf_counter() - start) / 3 * args.n_layers


def step_floor(model: torch.nn.Module, args, batch: int, seq_len: int) -> tuple[float, float, float]:
    """(linear FLOPs, their seconds at this CPU's best product rate, attention seconds in torch's kernel):
    no step of this model built on torch's attention is faster than the two seconds together. Linears:
    6 FLOPs per weight per token (forward, both gradients)."""
    tokens = batch * seq_len
    linear = 6 * tokens * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return linear, linear / best_gemm_rate(model, tokens), attention_seconds(args, batch, seq_len)


def in_memory_layout(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict in the Hub's one tensor per expert, packed as ``model`` holds its experts in
    memory where it does (transformers 5's ``mlp.experts.gate_up_proj`` [E, 2F, D], gate rows first, and
    ``down_proj`` [E, D, F])."""
    wanted = set(model.state_dict())
    per_expert = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
    out, experts = {}, {}
    for name, tensor in state.items():
        m = per_expert.fullmatch(name)
        if m and f"{m.group(1)}.gate_up_proj" in wanted:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = tensor
        else:
            out[name] = tensor
    for prefix, by_expert in experts.items():
        order = [by_expert[e] for e in sorted(by_expert)]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([w["gate"], w["up"]]) for w in order])
        out[f"{prefix}.down_proj"] = torch.stack([w["down"] for w in order])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes/llama3_debug.toml"))
    parser.add_argument("--flavor", default=None, help="override the recipe's model.flavor")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="titanctl with compile.enable on/off (default: the recipe's)")
    parser.add_argument("--linear", choices=["auto", "onednn", "aten"], default=None,
                        help="titanctl's training.cpu_linear (default: the recipe's)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--float8", action="store_true", help="also time titanctl with float8 linears")
    parser.add_argument("--norm", default="rmsnorm", choices=["rmsnorm", "fused_rmsnorm"],
                        help="fused_rmsnorm: also time titanctl with the fused norm")
    parser.add_argument("--isa", default="both", choices=["both", "native", "avx2"],
                        help="kernels of this CPU, of an AVX2-only one (see ISA_ENV), or both in turn")
    opts = parser.parse_args()
    if opts.isa == "both":
        run_per_isa([a for a in sys.argv[1:] if a not in ("--isa", "both")])
        return
    if opts.isa == "avx2" and any(os.environ.get(k) != v for k, v in ISA_ENV["avx2"].items()):
        parser.exit(2, "--isa avx2 needs its environment before torch loads: run with --isa both\n")

    cpu, bf16_units = cpu_description()
    if opts.dtype == "bfloat16" and not bf16_units:
        parser.exit(2, f"{cpu} has no bf16 units ({' / '.join(BF16_FLAGS)} not in /proc/cpuinfo): "
                       "bf16 would be emulated, not measured\n")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts.float8:
        from titanctl.parallel.converters.float8 import torchao_float8

        torchao_float8()  # before transformers imports torchao with its import-time warnings
    import transformers

    overrides = ["--training.local_batch_size", str(opts.batch), "--training.seq_len", str(opts.seq_len),
                 "--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "2",
                 "--parallelism.data_parallel_shard_degree", "1", "--activation_checkpoint.mode", "none"]
    if opts.flavor:
        overrides += ["--model.flavor", opts.flavor]
    if opts.compile is not None:
        overrides += ["--compile.enable", str(opts.compile).lower()]
    if opts.linear:
        overrides += ["--training.cpu_linear", opts.linear]
    cfg = load_config(opts.recipe, overrides)
    dims = ParallelDims.from_config(cfg.parallelism, 1)
    vocab = Tokenizer(cfg.model.tokenizer_path or DEFAULT_TOKENIZER_PATH).vocab_size
    args = model_args_from_config(cfg.model, vocab, opts.seq_len)
    cpu_device = torch.device("cpu")

    def titanctl_model(extra: list[str] | None = None):
        variant_cfg = load_config(opts.recipe, overrides + (extra or []))
        variant_args = model_args_from_config(variant_cfg.model, vocab, opts.seq_len)
        model = build_model_parts(variant_cfg, dims, variant_args, cpu_device).parts[0]
        return model, build_loss_fn(variant_cfg, tp=1)

    ours, ours_loss = titanctl_model()
    hf = hf_config(args)
    theirs = getattr(transformers, hf["architectures"][0])(transformers.AutoConfig.for_model(**hf))
    missing, unexpected = theirs.load_state_dict(in_memory_layout(to_hf_state_dict(ours.state_dict(), args), theirs),
                                                 strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if args.tie_embeddings else set()), missing

    torch.manual_seed(0)
    tokens = torch.randint(0, vocab, (opts.batch, opts.seq_len + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    dtype = getattr(torch, opts.dtype)
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)

    def make_step(model, forward, loss_fn):
        optimizer = build_optimizer([model], cfg.optimizer)
        scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, total_steps=1000)

        def step():
            with autocast:
                loss = loss_fn(forward(model), labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm, foreach=True)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    steps = {
        "titanctl": make_step(ours, lambda m: m(inputs), ours_loss),
        "transformers": make_step(theirs, lambda m: m(input_ids=inputs).logits, cross_entropy_loss),
    }
    if opts.float8:
        float8, float8_loss = titanctl_model(["--float8.enable_float8_linear", "true"])
        steps["titanctl+float8"] = make_step(float8, lambda m: m(inputs), float8_loss)
    if opts.norm == "fused_rmsnorm":
        fused, fused_loss = titanctl_model(["--model.norm_type", "fused_rmsnorm"])
        steps["titanctl+fused_rmsnorm"] = make_step(fused, lambda m: m(inputs), fused_loss)

    load_before = load_average()
    first, rates = alternating_rates(steps, opts.batch * opts.seq_len, opts.rounds, opts.steps_per_round)
    units = ", ".join(bf16_units) if bf16_units else "none"
    print(f"CPU {cpu}, {os.cpu_count()} cores, bf16 units: {units}; load average {load_before} -> {load_average()}")
    print(f"model {cfg.model.flavor} ({num_params(args) / 1e6:.1f}M params), batch {opts.batch} x {opts.seq_len}, "
          f"{opts.dtype}{' autocast' if dtype != torch.float32 else ''}, {torch.get_num_threads()} threads; "
          f"titanctl: compile {'on' if cfg.compile.enable else 'off'}, "
          f"linear kernel {linear_kernel(cfg.training.cpu_linear)} (training.cpu_linear = {cfg.training.cpu_linear})")
    for name in steps:
        rate = statistics.median(rates[name])
        print(f"{name:24s}{rate:10,.0f} tokens/s   first step {first[name]:6.2f} s "
              f"(rounds: {', '.join(f'{r:,.0f}' for r in rates[name])})")

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(rates[a], rates[b]))

    print(f"ratio titanctl/transformers = {ratio('titanctl', 'transformers'):.3f}")
    linear, linear_s, attention_s = step_floor(ours, args, opts.batch, opts.seq_len)
    theirs_step = opts.batch * opts.seq_len / statistics.median(rates["transformers"])
    print(f"floor: linears {linear / 1e9:.1f} GFLOP at this CPU's best product rate ({linear / linear_s / 1e9:.0f} "
          f"GFLOP/s) {linear_s * 1e3:.0f} ms + torch's attention kernel {attention_s * 1e3:.0f} ms; transformers' "
          f"step {theirs_step * 1e3:.0f} ms: a step on torch's attention beats it by at most "
          f"{theirs_step / (linear_s + attention_s):.2f}x (nothing else counted)")
    for name in steps:
        if name.startswith("titanctl+"):
            print(f"ratio {name}/titanctl = {ratio(name, 'titanctl'):.3f}")


if __name__ == "__main__":
    main()

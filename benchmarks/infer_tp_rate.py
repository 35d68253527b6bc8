"""What `titanctl infer-tp` reports, against transformers' `generate()` on the same checkpoint and prompt.

The script writes a checkpoint (a flavor with seeded random weights, as a Hugging Face folder with
the bundled tokenizer), then for a short and a long prompt runs the command as a user would: the
``titanctl`` binary, its default threads and decode-step choice (no OMP_NUM_THREADS), greedy,
``--out`` JSON. Its reported prefill and decode tokens/s (compile apart) are compared with
``generate()`` in this process at the thread counts the command reports it used, on the prompt ids
the command reports, in alternating rounds (a command run, then a ``generate()`` run), so load
from other processes hits both alike. Ratios are medians of the rounds'.

Each prompt's first command run gets a fresh inductor cache (TORCHINDUCTOR_CACHE_DIR, a new temporary
folder): its compile and first-token times are the cold ones; the later runs reuse that folder
(warm). The first token's time is read two ways: the command's own ``first_token_seconds`` (from
its process's start) and when its "first token" line reached this script's pipe (from launch).

    PYTHONPATH=. .venv/bin/python benchmarks/infer_tp_rate.py [--rounds 3] [--new-tokens 160]
        [--prompt-lens 32,1024] [--flavor debugmodel] [--isa native|avx2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_throughput import ISA_ENV, Theirs, export_model, isa_environment, load_average

from titanctl.data.datasets import load_documents
from titanctl.data.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def prompt_text(tokens: int) -> str:
    """About ``tokens`` tokens of the bundled validation text (the command adds BOS)."""
    text = " ".join(doc for _, doc in zip(range(200), load_documents("bundled_val", None)))
    tokenizer = Tokenizer()
    ids = tokenizer.encode(text, bos=False, eos=False)
    if len(ids) < tokens:
        raise SystemExit(f"the bundled text gives only {len(ids)} prompt tokens")
    return tokenizer.decode(ids[: tokens - 1])


def titanctl_command() -> list[str]:
    binary = Path(sys.executable).parent / "titanctl"
    return [str(binary)] if binary.exists() else [sys.executable, "-m", "titanctl"]


def infer_tp(folder: Path, prompt: str, new_tokens: int, cache_dir: Path, out: Path, env_extra: dict) -> dict:
    """One `titanctl infer-tp` run; its --out JSON plus ``seen_first_token``: seconds from launch to
    its "first token" line on stdout, and ``wall_seconds`` of the whole command."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR")}
    env.update({**OFFLINE, **env_extra, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)})
    cmd = [*titanctl_command(), "infer-tp", "--checkpoint", str(folder), "--prompt", prompt, "--temperature", "0",
           "--max-new-tokens", str(new_tokens), "--out", str(out)]
    seen = None
    with tempfile.TemporaryFile() as errors:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True, env=env, cwd=REPO)
        lines = []
        for line in proc.stdout:
            if seen is None and "first token" in line:
                seen = time.perf_counter() - start
            lines.append(line)
        code = proc.wait()
        wall = time.perf_counter() - start
        if code != 0:
            errors.seek(0)
            raise SystemExit(f"infer-tp exited with {code}:\n{''.join(lines)[-2000:]}\n"
                             f"{errors.read().decode(errors='replace')[-3000:]}")
    return {**json.loads(out.read_text()), "seen_first_token": seen, "wall_seconds": wall, "stdout": lines}


def median(values):
    return statistics.median(values) if values else float("nan")


def compare(folder: Path, length: int, opts, env_extra: dict, theirs_model: dict) -> dict:
    prompt = prompt_text(length)
    with tempfile.TemporaryDirectory(prefix="titanctl-inductor-") as cache, \
            tempfile.TemporaryDirectory(prefix="titanctl-infer-rate-") as tmp:
        runs = []
        ratios = {"prefill": [], "decode": []}
        theirs_rates = {"prefill": [], "decode": []}
        same_tokens = True
        for i in range(opts.rounds + 1):  # run 0: the cold inductor cache, not in the rates
            ours = infer_tp(folder, prompt, opts.new_tokens, Path(cache), Path(tmp) / f"run{i}.json", env_extra)
            runs.append(ours)
            if i == 0:
                for line in ours["stdout"]:
                    if line.startswith("infer-tp:"):
                        print(f"    {line.rstrip()}")
                continue
            threads = ours["threads"] or {"prefill": 0, "decode": 0}
            key = (threads["prefill"], threads["decode"])
            if key not in theirs_model:
                theirs_model[key] = Theirs(folder, threads["prefill"], threads["decode"],
                                           stop_tokens=Tokenizer().stop_tokens)
                theirs_model[key](ours["prompt_tokens"], 8)  # warm up
            t = theirs_model[key](ours["prompt_tokens"], opts.new_tokens)
            prefill = len(ours["prompt_tokens"]) / t.prefill_seconds
            decode = (len(t.tokens) - 1) / t.decode_seconds
            theirs_rates["prefill"].append(prefill)
            theirs_rates["decode"].append(decode)
            ratios["prefill"].append(ours["prefill_tokens_per_second"] / prefill)
            ratios["decode"].append(ours["decode_tokens_per_second"] / decode)
            same_tokens &= t.tokens == ours["tokens"]
        warm = runs[1:]
        return {
            "prompt_tokens": len(runs[0]["prompt_tokens"]),
            "cache_length": runs[0]["cache_length"],
            "compiled": runs[0]["compiled"],
            "threads": sorted({json.dumps(r["threads"]) for r in warm}),
            "ours": {"prefill": median([r["prefill_tokens_per_second"] for r in warm]),
                     "decode": median([r["decode_tokens_per_second"] for r in warm]),
                     "overall": median([r["tokens_per_second"] for r in warm])},
            "theirs": {k: median(v) for k, v in theirs_rates.items()},
            "ratio": {k: median(v) for k, v in ratios.items()},
            "same_tokens": same_tokens,
            "new_tokens": median([len(r["tokens"]) for r in warm]),
            "cold": {k: runs[0][k] for k in ("compile_seconds", "first_token_seconds", "seen_first_token",
                                              "wall_seconds")},
            "warm": {k: median([r[k] for r in warm if r[k] is not None])
                     for k in ("compile_seconds", "first_token_seconds", "seen_first_token", "wall_seconds")},
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--prompt-lens", default="32,1024", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3, help="warm command runs (and generate() runs) per prompt")
    parser.add_argument("--isa", choices=("native", "avx2"), default="native",
                        help="avx2: the command and generate() with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2")
    opts = parser.parse_args()
    env_extra = ISA_ENV[opts.isa]
    if any(os.environ.get(k) != v for k, v in env_extra.items()):  # torch reads them at import: start again
        sys.exit(subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=isa_environment(opts.isa)).returncode)
    lengths = [int(n) for n in opts.prompt_lens.split(",")]
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="titanctl-infer-rate-ckpt-") as tmp:
        folder = Path(tmp)
        args = export_model(opts.flavor, folder, max(lengths) + opts.new_tokens + 128)
        theirs: dict = {}
        results = {}
        for length in lengths:
            print(f"prompt of about {length} tokens: cold run (fresh inductor cache), then {opts.rounds} warm runs "
                  "alternating with generate()", flush=True)
            results[length] = compare(folder, length, opts, env_extra, theirs)
    print(f"\nmodel {opts.flavor} ({args.dim} dim, {args.n_layers} layers), {opts.new_tokens} new tokens, greedy, "
          f"fp32; CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores, "
          f"load average {load_before} -> {load_average()}")
    print(f"{'prompt':>7s} {'cache':>6s} {'threads (prefill/decode)':>26s} {'infer-tp prefill':>17s} "
          f"{'decode':>8s} {'generate() prefill':>19s} {'decode':>8s} {'ratio prefill':>14s} {'decode':>7s}  "
          "same tokens")
    for r in results.values():
        threads = ", ".join(f"{t['prefill']}/{t['decode']}" for t in map(json.loads, r["threads"]) if t)
        print(f"{r['prompt_tokens']:7d} {r['cache_length']:6d} {threads or '-':>26s} {r['ours']['prefill']:17,.0f} "
              f"{r['ours']['decode']:8,.1f} {r['theirs']['prefill']:19,.0f} {r['theirs']['decode']:8,.1f} "
              f"{r['ratio']['prefill']:14.2f} {r['ratio']['decode']:7.2f}  {r['same_tokens']}")
    print("\nfirst token and compile, seconds (cold: fresh inductor cache; warm: median of the later runs); "
          "first token from the command's start (its own clock / its line seen on the pipe)")
    for r in results.values():
        for kind in ("cold", "warm"):
            t = r[kind]
            seen = "-" if t["seen_first_token"] is None else f"{t['seen_first_token']:.1f}"
            own = "-" if t["first_token_seconds"] is None else f"{t['first_token_seconds']:.1f}"
            print(f"  prompt {r['prompt_tokens']:5d}, {kind}: first token {own} / {seen} s, "
                  f"compile {t['compile_seconds']:.1f} s, whole command {t['wall_seconds']:.1f} s")


if __name__ == "__main__":
    main()

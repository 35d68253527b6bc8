"""Context parallel's figures: the load imbalance before and after mask-aware balancing on a realistic
document-length mix, and (``--steps``) step time and per-rank peak memory of CP 1, 2, 4 as ratios to CP 1.

Imbalance (always; CPU-light, seconds): the most loaded CP rank's attention work / the mean, work being the
(query, key) pairs the mask lets a rank's queries attend (titanctl/parallel/layouts/cp_balance.py), for
windows packed from documents whose lengths are drawn log-normal with a median of 500 tokens and sigma 1.3
(mean ~1,200 tokens; 1% of documents above ~10,000): many short web pages and a long tail of long ones, the
shape reported for web-text pretraining corpora (C4, FineWeb); an assumption here, not a measured corpus.
Documents run across window boundaries as the loader packs them. Rows: each CP degree and sequence length,
``--rows`` sequences per microbatch (the work of a microbatch's rows adds up; one order serves them all),
over ``--batches`` microbatches: the mean and the worst imbalance of

- causal head-tail (one document per window, torch's ring order),
- head-tail under the document mask (``context_parallel_load_balancer = head_tail``),
- mask-aware under the document mask (the default), and the milliseconds it took to choose the order,
- the same two for gpt-oss's layers (sliding window 128 alternating with full attention) under documents.

Step time and memory (``--steps``): ``titanctl train`` under torchrun on the debug recipe at ``--seq-len``
(one sequence per step, 3 steps, the first left out), for each CP degree, method (ring, Ulysses) and mask
(causal; block_causal over the same document mix written as a jsonl), and prints step time and rank 0's peak
resident memory (CPU: the process's peak RSS, torch's own ~0.4 GiB included) as ratios to CP 1 of the same
method and mask, with the imbalance the run logged. On a loaded machine the times vary several-fold; rerun
quiet for figures.

    PYTHONPATH=. .venv/bin/python benchmarks/context_parallel.py [--batches 50] [--rows 1]
    PYTHONPATH=. .venv/bin/python benchmarks/context_parallel.py --steps [--seq-len 16384] [--cp 1 2 4]
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

from titanctl.parallel.layouts.context_parallel import load_balanced_order
from titanctl.parallel.layouts.cp_balance import attention_work, imbalance, mask_aware_order, rank_work

REPO = Path(__file__).resolve().parents[1]
MEDIAN_TOKENS, SIGMA = 500, 1.3
GPT_OSS_WINDOW = 128


def document_lengths(count: int, generator: torch.Generator) -> list[int]:
    """Log-normal document lengths in tokens (at least 2: BOS and one token)."""
    mu = torch.tensor(float(MEDIAN_TOKENS)).log().item()
    return torch.empty(count).log_normal_(mu, SIGMA, generator=generator).clamp(min=2).long().tolist()


def packed_doc_ids(rows: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """(rows, seq_len) document ids of windows cut from a stream of packed documents, each window starting
    at a random offset into its first document (as a window of a long stream does)."""
    out = torch.empty(rows, seq_len, dtype=torch.long)
    for row in out:
        lengths = document_lengths(64 + seq_len // 100, generator)
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        while ids.numel() < 2 * seq_len:
            ids = torch.cat([ids, ids + len(lengths)])
        start = int(torch.randint(0, lengths[0], (1,), generator=generator))
        row.copy_(ids[start:start + seq_len])
    return out


def imbalance_table(args) -> None:
    generator = torch.Generator().manual_seed(0)
    print(f"document lengths: log-normal, median {MEDIAN_TOKENS} tokens, sigma {SIGMA}; {args.rows} row(s) "
          f"a microbatch, {args.batches} microbatches a row of the table; imbalance = max rank / mean "
          f"(mean, worst)")
    header = (f"{'seq':>7} {'cp':>3} | {'causal ht':>10} | {'docs ht':>14} {'docs mask-aware':>16} {'ms':>6} | "
              f"{'gpt-oss ht':>14} {'gpt-oss m-a':>14}")
    print(header)
    print("-" * len(header))
    gpt_oss = [None, GPT_OSS_WINDOW] * 12  # 24 layers alternating full and sliding
    for seq_len in args.seq_lens:
        for cp in args.cp:
            if cp == 1:
                continue
            causal = imbalance(rank_work(attention_work(None, seq_len, [None]), load_balanced_order(seq_len, cp), cp))
            got: dict[str, list[float]] = {"ht": [], "ma": [], "ms": [], "oss_ht": [], "oss_ma": []}
            for _ in range(args.batches):
                doc_ids = packed_doc_ids(args.rows, seq_len, generator)
                head_tail = load_balanced_order(seq_len, cp)
                work = attention_work(doc_ids, seq_len, [None])
                started = time.perf_counter()
                order = mask_aware_order(work, cp)
                got["ms"].append((time.perf_counter() - started) * 1e3)
                got["ht"].append(imbalance(rank_work(work, head_tail, cp)))
                got["ma"].append(imbalance(rank_work(work, order, cp)))
                work = attention_work(doc_ids, seq_len, gpt_oss)
                got["oss_ht"].append(imbalance(rank_work(work, head_tail, cp)))
                got["oss_ma"].append(imbalance(rank_work(work, mask_aware_order(work, cp), cp)))

            cell = {key: f"{statistics.mean(v):.3f} ({max(v):.3f})" for key, v in got.items()}
            print(f"{seq_len:>7} {cp:>3} | {causal:>10.3f} | {cell['ht']:>14} {cell['ma']:>16} "
                  f"{statistics.median(got['ms']):>6.1f} | {cell['oss_ht']:>14} {cell['oss_ma']:>14}")


def write_documents(path: Path, seq_len: int) -> None:
    """A jsonl of documents of the mix's lengths, in words (about one token each with the bundled tokenizer)."""
    generator = torch.Generator().manual_seed(1)
    words = "the of and to in a is that for it as with was on be by at this had not are but from or".split()
    with path.open("w") as f:
        for length in document_lengths(max(200, 8 * seq_len // MEDIAN_TOKENS), generator):
            f.write(json.dumps({"text": " ".join(words[(length + i) % len(words)] for i in range(length))}) + "\n")


def train_run(nproc: int, overrides: list[str], folder: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "titanctl", "train", "--config", str(REPO / "recipes/llama3_debug.toml"),
           "--job.dump_folder", str(folder), "--training.steps", "3", "--metrics.log_freq", "1",
           "--training.local_batch_size", "1", "--training.global_batch_size", "1",
           "--parallelism.data_parallel_shard_degree", "1", "--checkpoint.enable_checkpoint", "false",
           # a step at 16k-32k tokens on a few shared cores outlasts the default 100 s collective timeout
           "--comm.train_timeout_seconds", "7200", *overrides]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TIKTOKEN_CACHE_DIR": "", "HF_HOME": str(folder / "hf")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:  # the first line naming an error, not torchrun's closing banner
        lines = (proc.stderr + proc.stdout).splitlines()
        errors = [line for line in lines if "Error" in line or line.startswith("error")]
        cause = (errors or lines or [""])[0 if errors else -1]
        return {"error": cause.strip()[:200]}
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows
    return {"step_time": statistics.median(r["step_time"] for r in later),
            "memory_gib": max(r["memory_gib"] for r in rows),
            "cp_imbalance": later[-1].get("cp_imbalance")}


def steps_table(args) -> None:
    with tempfile.TemporaryDirectory(prefix="cp-bench-") as tmp:
        docs = Path(tmp) / "documents.jsonl"
        write_documents(docs, args.seq_len)
        masks = {"causal": ["--model.attn_mask_type", "causal"],
                 "block_causal": ["--model.attn_mask_type", "block_causal", "--training.dataset", "local",
                                  "--training.dataset_path", str(docs)]}
        print(f"\ndebug model (recipes/llama3_debug.toml), seq {args.seq_len}, 1 sequence a step, median of steps "
              f"2-3; ratios to CP 1 of the same method and mask; memory: rank 0's peak RSS")
        print(f"{'method':>8} {'mask':>13} {'cp':>3} {'step_time s':>12} {'x cp1':>7} {'memory GiB':>11} {'x cp1':>7} "
              f"{'cp_imbalance':>13}")
        base: dict[str, dict] = {}  # mask -> the CP 1 run (ring and Ulysses are the same step there)
        for method in ("ring", "ulysses"):
            for mask, mask_args in masks.items():
                for cp in args.cp:
                    if cp == 1 and method == "ulysses":
                        continue
                    run = train_run(cp, ["--training.seq_len", str(args.seq_len),
                                         "--parallelism.context_parallel_degree", str(cp),
                                         "--parallelism.context_parallel_method", method, *mask_args],
                                    Path(tmp) / f"{method}-{mask}-cp{cp}")
                    if "error" in run:
                        print(f"{method:>8} {mask:>13} {cp:>3}  failed: {run['error']}", flush=True)
                        continue
                    ref = base.setdefault(mask, run)
                    imb = "-" if run["cp_imbalance"] is None else f"{run['cp_imbalance']:.3f}"
                    print(f"{method:>8} {mask:>13} {cp:>3} {run['step_time']:>12.2f} "
                          f"{run['step_time'] / ref['step_time']:>7.2f} {run['memory_gib']:>11.2f} "
                          f"{run['memory_gib'] / ref['memory_gib']:>7.2f} {imb:>13}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 32768, 131072])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", action="store_true", help="also time titanctl train under torchrun")
    parser.add_argument("--seq-len", type=int, default=16384, help="--steps: the training sequence length")
    args = parser.parse_args()
    imbalance_table(args)
    if args.steps:
        args.cp = [cp for cp in args.cp if cp <= 4]
        steps_table(args)


if __name__ == "__main__":
    main()

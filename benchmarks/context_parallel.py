"""Context parallel's load imbalance before and after mask-aware balancing on a realistic document-length mix
(step memory and CPU time per rank: benchmarks/cp_steps.py).

The imbalance: the most loaded CP rank's attention work / the mean, work being the
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

Counted, not timed (but the milliseconds), so the machine's load does not move it; CPU-light, seconds.

    PYTHONPATH=. .venv/bin/python benchmarks/context_parallel.py [--batches 50] [--rows 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from titanctl.parallel.layouts.context_parallel import load_balanced_order
from titanctl.parallel.layouts.cp_balance import attention_work, imbalance, mask_aware_order, rank_work

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 32768, 131072])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    imbalance_table(args)


if __name__ == "__main__":
    main()

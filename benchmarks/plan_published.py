"""`titanctl plan`'s GPU cost model against torchtitan's published H100 measurements.

No GPU is needed: the cost model predicts each published layout (torchtitan's docs/performance.md,
the TorchTitan paper's runs: Llama 3.1 8B to 405B on 8 to 512 H100, FSDP, CP, 2-D and 3-D layouts)
on the h100 preset with the measured machines' memory, and this prints

1. predicted and published tokens/s per GPU, and their ratio (a 500 W H100 runs below the SXM
   datasheet's clocks, so a common factor above 1 is expected: what matters is its spread);
2. what each technique buys (compile, Float8, 8 -> 128 GPUs, async TP, interleaving), published
   against predicted;
3. for the four published layouts the paper calls its best, where the planner ranks each among every
   layout it considers with the same model, sequence length, global batch and activation
   checkpointing, and what it ranks first.

    PYTHONPATH=. .venv/bin/python benchmarks/plan_published.py [--device h100] [--no-search]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The paper's best layout per scale: (table of MEASUREMENTS, GPUs).
BEST = (("1: FSDP + compile + Float8", 8), ("3: FSDP + compile + Float8", 128), ("4: 2D + AsyncTP", 256),
        ("5: Interleaved 1F1B", 512))


def degrees(c) -> tuple[int, ...]:
    return c.dp_replicate, c.dp_shard, c.tp, c.pp, c.cp, c.ep


def rank_in_search(measurement, device, world_size: int):
    """(1-based rank of the published layout or None, layouts ranked, the first, and the 1-based rank and
    layout of the best with the published degrees: any schedule, microbatches, features)."""
    from titanctl.planning.plan.published import measurement_config
    from titanctl.planning.plan.search import ac_modes_from, plan

    cfg = measurement_config(measurement)
    result = plan(measurement.recipe, cfg, world_size, device, global_batch=measurement.global_batch,
                  top=10**9, exact=0, ac_modes=ac_modes_from("recipe", cfg))
    rank = next((i for i, lay in enumerate(result.layouts, 1) if lay.candidate == measurement.layout), None)
    kind = next(((i, lay) for i, lay in enumerate(result.layouts, 1)
                 if degrees(lay.candidate) == degrees(measurement.layout)), (None, None))
    return rank, len(result.layouts), result.layouts[0], kind


def describe(layout) -> str:
    c = layout.candidate
    return (f"{c.describe()} ({c.features()}, batch {c.local_batch_size} x {c.grad_accum}): "
            f"{layout.tokens_per_second_per_device:,.0f} tokens/s per GPU")


def slower(layout, first) -> str:
    return f"predicted {layout.time.step / first.time.step - 1:+.1%} against #1"


def main() -> int:
    from titanctl.planning.plan.devices import PRESETS
    from titanctl.planning.plan.published import A100_MEASUREMENTS, gains, grand_teton, predict

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="h100", choices=sorted(PRESETS), help="preset whose assumptions to check")
    parser.add_argument("--no-search", action="store_true", help="skip the ranking searches (about 20 s)")
    args = parser.parse_args()
    device = grand_teton(PRESETS[args.device])

    predictions = predict(device)
    print(f"{'published (docs/performance.md table)':30} {'model':>5} {'layout':44} {'tokens/s per GPU':>24}"
          f" {'memory GiB':>18}")
    print(f"{'':81} {'published':>9} {'predicted':>9} {'ratio':>5} {'published':>9} {'fast':>5} {'ratio':>5}")
    ratios, memory = [], []
    for p in predictions:
        m = p.measurement
        ratios.append(p.tokens_per_second_per_gpu / m.tokens_per_second_per_gpu)
        memory.append(p.memory_gib / m.memory_gib)
        name = Path(m.recipe).stem.removeprefix("llama3_")
        print(f"{m.table:30} {name:>5} {m.layout.describe()[:44]:44} {m.tokens_per_second_per_gpu:9,.0f} "
              f"{p.tokens_per_second_per_gpu:9,.0f} {ratios[-1]:5.2f} {m.memory_gib:9.1f} {p.memory_gib:5.1f} "
              f"{memory[-1]:5.2f}")
    median = statistics.median(ratios)
    spread = [r / median - 1 for r in ratios]
    print(f"\ntokens/s, predicted / published: median {median:.2f}, from {min(ratios):.2f} to {max(ratios):.2f} "
          f"({min(spread):+.0%} to {max(spread):+.0%} around the median)")
    print(f"memory, fast estimate / published: {min(memory):.2f} to {max(memory):.2f} (published: what the "
          "allocator reserved, allocated memory plus its slack)")
    a100 = predict(PRESETS["a100"], A100_MEASUREMENTS)
    print("\nFSDP alone on 64 A100 80GB (the a100 preset; torchtitan's earlier table, eager bf16):")
    for p in a100:
        m = p.measurement
        ratio = p.tokens_per_second_per_gpu / m.tokens_per_second_per_gpu
        print(f"  Llama 3 {m.table:22} {m.layout.describe():14} published {m.tokens_per_second_per_gpu:6,.0f}  "
              f"predicted {p.tokens_per_second_per_gpu:6,.0f}  ratio {ratio:.2f}")
    print(f"\n{'what a technique buys':46} {'published':>9} {'predicted':>9}")
    for name, (published, predicted) in gains(predictions).items():
        print(f"{name:46} {published:9.3f} {predicted:9.3f}")

    if args.no_search:
        return 0
    by_table = {p.measurement.table: p for p in predictions}
    print("\nthe paper's best layouts among everything the planner considers (same model, sequence, global batch, AC):")
    for table, gpus in BEST:
        m, published = by_table[table].measurement, by_table[table].layout
        rank, total, first, (kind_rank, kind) = rank_in_search(m, device, gpus)
        where = f"#{rank:,} of {total:,}" if rank else f"not among the {total:,} that fit"
        print(f"  {Path(m.recipe).stem} on {gpus} GPUs: #1 {describe(first)}")
        print(f"    published {describe(published)}: {where}, {slower(published, first)}")
        if kind is not None and kind_rank != rank:
            print(f"    best with its degrees: #{kind_rank:,} {describe(kind)}, {slower(kind, first)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`titanctl profile`: train a few steps under torch.profiler and say where the time went."""

from __future__ import annotations

from pathlib import Path

import typer

from titanctl.gc_pauses import heavy_imports


def profile(
    ctx: typer.Context,
    config: Path | None = typer.Option(None, "--config", help="Recipe TOML (recipes/*.toml)."),
    steps: int = typer.Option(
        5, "--steps", min=1, max=1000,
        help="Training steps to run; the last is recorded, after up to 3 warmup steps.",
    ),
    top: int = typer.Option(15, "--top", min=0, help="How many operators to list, by self time."),
) -> None:
    """Record one training step's trace and memory timeline per rank, then summarize them.

    Any config key can be overridden: --section.key VALUE, except training.steps (--steps sets it),
    profiling.enable_profiling and profile_freq, and the checkpoint keys other than initial_load_path,
    initial_load_model_weights_only and exclude_from_loading: checkpointing is off while profiling.
    """
    from titanctl.config.recipe import load_config

    cfg = load_config(config, ctx.args, command="profile")  # before torch is imported: mistakes fail fast
    with heavy_imports():
        from titanctl.observability import profile_run as profiling

    summary = profiling.run(cfg, steps=steps, top=top)
    if summary is not None:  # rank 0
        _print_summary(summary, top)


def _print_summary(summary, top: int) -> None:
    from rich.table import Table

    from titanctl.cli.console import wide_console
    from titanctl.observability.trace_analysis import format_us
    from titanctl.safe_io import shown

    out = wide_console(160)
    report = summary.report
    n = len(report.ranks)
    out.print(f"\n[bold]Where the time went[/bold]: step {summary.step}, {n} rank(s), "
              f"traces in {shown(summary.folder)}")
    table = Table(title="time per rank (CPU timeline)" if report.ranks[0].timeline == "cpu" else "time per rank",
                  title_justify="left")
    for col in ("rank", "step time", "compute", "communication", "exposed comm", "peak memory (profiled)"):
        table.add_column(col, justify="left" if col == "rank" else "right")
    stragglers = {s.rank for s in report.stragglers}
    for p in report.ranks:
        step = p.step_us or 1.0
        peaks = summary.peak_memory_bytes.get(p.rank, {})
        memory = ", ".join(f"{d} {b / 2**20:.1f} MiB" for d, b in peaks.items()) or "-"
        table.add_row(
            str(p.rank), format_us(p.step_us),
            f"{format_us(p.compute_us)} ({100 * p.compute_us / step:.0f}%)",
            f"{format_us(p.comm_us)} ({100 * p.comm_us / step:.0f}%)",
            f"{format_us(p.exposed_comm_us)} ({100 * p.exposed_comm_us / step:.0f}%)",
            memory, style="red" if p.rank in stragglers else "",
        )
    out.print(table)
    for line in report.summary:  # the cross-rank verdict: stragglers, or none
        out.print(f"[{'bold red' if report.stragglers else 'green'}]{shown(line)}[/]", soft_wrap=True)
    if top and summary.top_ops:
        ops = Table(title=f"top {len(summary.top_ops)} operators by self time"
                    + (" (mean over ranks)" if n > 1 else ""), title_justify="left")
        ops.add_column("operator")
        ops.add_column("kind")
        ranks = [p.rank for p in report.ranks]
        listed = ranks if n <= 4 else []
        for r in listed:
            ops.add_column(f"rank {r}" if n > 1 else "self", justify="right")
        if not listed:
            for col in ("min", "mean", "max"):
                ops.add_column(col, justify="right")
        ops.add_column("calls" if n == 1 else "calls (rank 0)", justify="right")
        for o in summary.top_ops:
            values = [o.self_us[r] for r in ranks]
            cells = [format_us(o.self_us[r]) for r in listed] or [
                format_us(min(values)), format_us(o.mean_self_us), format_us(max(values))]
            ops.add_row(shown(o.name), "communication" if o.communication else "", *cells,
                        str(o.calls[ranks[0]]))
        out.print(ops)
    out.print(f"open the traces at https://ui.perfetto.dev, or: titanctl inspect-trace {shown(summary.folder)}",
              soft_wrap=True)

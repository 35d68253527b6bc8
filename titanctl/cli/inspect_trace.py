"""`titanctl inspect-trace`: profiler traces (what is slow) and Flight Recorder dumps (which rank hangs)."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def inspect_trace(
    path: Path = typer.Argument(..., help="A trace/dump file, or a folder with one per rank."),
    top: int = typer.Option(10, "--top", min=0, help="How many operators to list per rank, by self time."),
    straggler_pct: float = typer.Option(
        10.0, "--straggler-pct", min=0.0,
        help="A rank this many percent above the median compute/step time is a straggler.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON instead of tables."),
    max_size_mib: int = typer.Option(
        1024, "--max-size-mib", min=1, help="Refuse a file larger than this once decompressed (MiB)."
    ),
) -> None:
    """Read profiler traces and Flight Recorder dumps: what is slow, which rank hangs."""
    from titanctl.observability.trace_analysis import inspect_path

    result = inspect_path(path, top=top, threshold_pct=straggler_pct, max_mib=max_size_mib)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
        return
    from titanctl.cli.console import wide_console

    out = wide_console(160)
    if result.flight_recorder is not None:
        _print_flight_recorder(out, result.flight_recorder)
    if result.profile is not None:
        _print_profile(out, result.profile, top)
    if result.skipped:
        out.print(f"[dim]skipped {len(result.skipped)} file(s) that are neither traces nor dumps[/dim]")


def _print_flight_recorder(out, report) -> None:
    from rich.table import Table

    where = "".join(f", replica group {g}" for g in report.replica_groups)
    out.print(f"[bold]Flight Recorder[/bold]: {len(report.dumps)} dump(s){where}, ranks {_ranks(report.ranks)}")
    table = Table(title="last collective of each rank, per process group", title_justify="left")
    for col in ("group", "rank", "last collective", "state", "note"):
        table.add_column(col)
    for group in report.groups:
        style = "bold red" if group.mismatch else "green"
        out.print(f"[{style}]{_esc(group.message)}[/{style}]", soft_wrap=True)
        for s in group.ranks_state:
            culprit = group.mismatch is not None and s.rank in group.mismatch.culprits
            table.add_row(
                _esc(f"{group.name} {group.desc}".strip()), str(s.rank), _esc(s.last or "-"), _esc(s.state or "-"),
                _esc(s.note),
                style="red" if culprit else "",
            )
        table.add_section()
    if report.groups:
        out.print(table)
    if not report.culprits:
        out.print(f"[{'green' if report.groups else 'yellow'}]{_esc(report.summary[0])}[/]", soft_wrap=True)
    for note in report.notes:
        out.print(f"[yellow]note:[/yellow] {_esc(note)}", soft_wrap=True)


def _print_profile(out, report, top: int) -> None:
    from rich.table import Table

    from titanctl.observability.trace_analysis import format_us

    table = Table(title="Profiler traces: time per rank", title_justify="left")
    for col in ("rank", "timeline", "steps", "step time", "compute", "comm", "overlap", "exposed comm"):
        table.add_column(col, justify="left" if col in ("rank", "timeline") else "right")
    stragglers = {s.rank for s in report.stragglers}
    for p in report.ranks:
        table.add_row(
            str(p.rank), p.timeline, str(p.steps or "-"), format_us(p.step_us), format_us(p.compute_us),
            format_us(p.comm_us), format_us(p.overlap_us), format_us(p.exposed_comm_us),
            style="red" if p.rank in stragglers else "",
        )
    out.print(table)
    for line in report.summary:
        out.print(f"[{'bold red' if report.stragglers else 'green'}]{_esc(line)}[/]", soft_wrap=True)
    if top > 0:
        for p in report.ranks:
            ops = Table(title=f"rank {p.rank}: top {len(p.top_ops)} operators by self time", title_justify="left")
            for col in ("operator", "calls", "self", "total", "kind"):
                ops.add_column(col, justify="left" if col in ("operator", "kind") else "right")
            for o in p.top_ops:
                ops.add_row(_esc(o.name), str(o.calls), format_us(o.self_us), format_us(o.total_us),
                            "communication" if o.communication else "")
            out.print(ops)
    skipped = sum(p.skipped_events for p in report.ranks)
    if skipped:
        out.print(f"[yellow]note:[/yellow] {skipped} event(s) without usable ts/dur were skipped")


def _ranks(ranks: list[int]) -> str:
    from titanctl.observability.fr_analysis import format_ranks

    return format_ranks(ranks)


def _esc(text) -> str:
    """Op names, messages and paths come from the traces: shown, never obeyed."""
    from titanctl.safe_io import shown

    return shown(text)

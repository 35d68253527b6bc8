"""`titanctl plan`: which layout to run a recipe with on N devices: the fastest that fit, and how to launch them."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def plan(
    config: Path | None = typer.Option(None, "--config", help="Recipe TOML (recipes/*.toml)."),
    gpus: int = typer.Option(0, "--gpus", help="Devices of the job (GPUs, or CPU processes); with --calibrate, "
                             "the processes to measure with."),
    device: str | None = typer.Option(None, "--device", help="h100, h200, b200, a100, mi300x (datasheet figures), "
                                      "or cpu (figures from --calibrate)."),
    cluster: Path | None = typer.Option(None, "--cluster", help="Cluster file (TOML, a [device] table): the device's "
                                        "figures; --calibrate writes it."),
    calibrate: bool = typer.Option(False, "--calibrate", help="Measure this machine's CPU matmul, attention and "
                                   "memory rates and its gloo collectives with --gpus processes (a minute or two), "
                                   "write them to --cluster, then plan if --config is given (--device cpu)."),
    peak_tflops: float | None = typer.Option(None, "--peak-tflops", help="Dense bf16 TFLOP/s per device.", min=0),
    peak_fp8_tflops: float | None = typer.Option(None, "--peak-fp8-tflops", help="Dense fp8 TFLOP/s (0: none).", min=0),
    memory_gib: float | None = typer.Option(None, "--memory-gib", help="Memory per device, GiB.", min=0),
    memory_bandwidth: float | None = typer.Option(None, "--memory-bandwidth-gbps", help="Memory bandwidth, GB/s.",
                                                  min=0),
    intra_gbps: float | None = typer.Option(None, "--intra-node-gbps", help="Intra-node bandwidth per device and "
                                            "direction, GB/s.", min=0),
    intra_latency: float | None = typer.Option(None, "--intra-node-latency-us", help="Intra-node latency, us.", min=0),
    inter_gbps: float | None = typer.Option(None, "--inter-node-gbps", help="Network bandwidth per device and "
                                            "direction, GB/s.", min=0),
    inter_latency: float | None = typer.Option(None, "--inter-node-latency-us", help="Network latency, us.", min=0),
    gpus_per_node: int | None = typer.Option(None, "--gpus-per-node", help="Devices per node.", min=1),
    global_batch: int | None = typer.Option(None, "--global-batch", help="Sequences per optimizer step (default: the "
                                            "recipe's global_batch_size, else its local batch x its data-parallel "
                                            "degree on --gpus).", min=1),
    top: int = typer.Option(5, "--top", help="Layouts to show.", min=1),
    exact: int = typer.Option(3, "--exact", help="Finalists whose memory estimate-memory's engine computes exactly "
                              "(within --budget-seconds).", min=0),
    budget_seconds: float = typer.Option(45.0, "--budget-seconds", help="Seconds (from the start) after which "
                                         "exact estimates stop; a running one is stopped, the rest keep the fast "
                                         "figure.", min=0),
    ac: str = typer.Option("all", "--ac", help="Activation checkpointing modes to consider: all, recipe (the "
                           "recipe's), or a comma list of none, selective_op, selective_2, full."),
    float8: bool = typer.Option(True, "--float8/--no-float8", help="Consider Float8 linears where the device has "
                                "fp8 units (they change the numerics slightly)."),
    as_json: bool = typer.Option(False, "--json", help="Print the layouts as a JSON list instead of tables."),
) -> None:
    """The fastest layouts of a recipe on N devices that fit: degrees, pipeline schedule, activation
    checkpointing, compile, Float8; with memory, step time, tokens/s per device, MFU, and the command
    line to run each."""
    from titanctl.errors import ConfigError
    from titanctl.planning.plan.devices import resolve_device

    figures = {
        "peak_bf16_tflops": peak_tflops, "peak_fp8_tflops": peak_fp8_tflops, "memory_gib": memory_gib,
        "memory_bandwidth_gbps": memory_bandwidth, "intra_node_gbps": intra_gbps,
        "intra_node_latency_us": intra_latency, "inter_node_gbps": inter_gbps,
        "inter_node_latency_us": inter_latency, "gpus_per_node": gpus_per_node,
    }
    if gpus < 1:
        raise ConfigError(f"--gpus must be at least 1, got {gpus}")
    from titanctl.planning.plan import calibrate as calibration
    from titanctl.planning.plan.search import ac_modes_from, check_tokens_per_step, check_world_size, recipe_config
    from titanctl.planning.plan.search import plan as make_plan

    # Everything that can be refused is, before minutes of measuring or enumerating.
    if calibrate:
        if cluster is None:
            raise ConfigError("--calibrate writes its measurements to --cluster FILE.toml: give one")
        if device not in (None, "cpu"):
            # The probes run on CPU processes over gloo: their figures would describe this host, not the GPU named.
            raise ConfigError(f"--calibrate measures CPU processes over gloo (--device cpu), not --device {device}: "
                              f"plan for {device} with its preset, or a cluster file with its measured figures")
        calibration.check_processes(gpus)
        calibration.check_writable(cluster)
    else:
        check_world_size(gpus)
    cfg = recipe_config(config) if config is not None else None
    if cfg is not None and global_batch is not None:
        check_tokens_per_step(global_batch, cfg.training.seq_len, "--global-batch")
    if calibrate:
        measured = calibration.calibrate(gpus, cluster, log=None if as_json else typer.echo)
        if not as_json:
            typer.echo(f"wrote {cluster}: {measured}")
        if config is None:
            return
        device = None
    if config is None:
        raise ConfigError("give --config RECIPE.toml (recipes/*.toml)")
    resolved = resolve_device(device, cluster, figures)
    result = make_plan(
        str(config), cfg, gpus, resolved, global_batch=global_batch, top=top, exact=exact,
        budget_seconds=budget_seconds, float8=float8, ac_modes=ac_modes_from(ac, cfg),
        log=lambda text: typer.echo(f"plan: {text}", err=True),
    )
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2))
        return
    print_plan(result)


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f}"


def print_plan(result) -> None:
    from rich.table import Table

    from titanctl.cli.console import wide_console
    from titanctl.safe_io import shown

    d = result.device
    out = wide_console(160)
    out.print(
        f"[bold]titanctl plan[/bold] {shown(result.recipe)}: {result.model} on {result.world_size} x {d.name} "
        f"({d.memory_gib:.0f} GiB, {d.gpus_per_node} per node), global batch {result.global_batch} x "
        f"{result.seq_len} tokens",
        soft_wrap=True,
    )
    table = Table()
    for col in ("#", "layout", "batch", "features", "memory GiB", "step s", "tokens/s/device", "MFU", "dominated by"):
        numeric = col in ("#", "memory GiB", "step s", "tokens/s/device", "MFU")
        table.add_column(col, justify="right" if numeric else "left")
    for i, layout in enumerate(result.layouts, 1):
        c, t = layout.candidate, layout.time
        batch = (f"{c.local_batch_size} x {c.grad_accum}" if c.pp == 1
                 else f"{c.microbatches} mb of {c.pp_microbatch_size}")
        exact = " (exact)" if layout.memory_is_exact else " (later rank)" if layout.exact_memory is not None else ""
        memory = _gib(layout.memory) + exact
        table.add_row(str(i), c.describe(), batch, c.features(), memory, f"{t.step:.3f}",
                      f"{layout.tokens_per_second_per_device:,.0f}", f"{100 * layout.mfu:.1f}%", t.dominant)
    out.print(table)
    out.print("batch: local batch x gradient accumulation, or pipeline microbatches; memory: rank 0's peak from "
              "estimate-memory (exact), or the fast estimate of the busiest pipeline rank (later rank: a pipeline "
              f"rank after rank 0, which the exact estimate does not run, holds more), without the "
              f"{d.memory_reserve_gib:g} GiB reserve", soft_wrap=True)
    for i, layout in enumerate(result.layouts, 1):
        cmd = result.commands(layout)
        terms = ", ".join(f"{name} {seconds:.3g}" for name, seconds in
                          sorted(layout.time.terms.items(), key=lambda kv: -kv[1]) if seconds > 0)
        out.print(f"\n[bold]#{i}[/bold] {terms} (s)", soft_wrap=True)
        out.print(f"  {shown(cmd['torchrun'])}", soft_wrap=True, highlight=False)
        if cmd["nodes"] > 1:
            out.print(f"  {shown(cmd['slurm'])}", soft_wrap=True, highlight=False)
    refused = ", ".join(f"{reason} ({count:,})" for reason, count in result.rejected.most_common())
    out.print(f"\n{result.considered:,} layouts considered; left out: {refused or 'none'}", soft_wrap=True)
    for note in result.notes:
        out.print(f"[yellow]note:[/yellow] {note}", soft_wrap=True)
    out.print(f"planned in {result.seconds:.1f} s; figures: {d.source or 'command line'}", soft_wrap=True)

"""`titanctl estimate-memory`: peak memory of one training step on rank 0, without the hardware."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from titanctl.gc_pauses import heavy_imports


def estimate_memory(
    ctx: typer.Context,
    config: Path | None = typer.Option(None, "--config", help="Recipe TOML (recipes/*.toml)."),
    world_size: int = typer.Option(..., "--world-size", help="Ranks of the job (GPUs, or CPU processes)."),
    device: str = typer.Option(
        "auto", "--device", help="Device to estimate for: auto (the recipe's: GPUs for 8B/70B/405B), cuda, cpu."
    ),
    validate: bool = typer.Option(
        False, "--validate", help="Also run the real step on the current processes (CPU or GPUs: alone or "
        "under torchrun) and compare the measured peak with the estimate."
    ),
    all_layers: bool = typer.Option(
        False, "--all-layers", help="Run every layer instead of extrapolating deep models from shallow ones "
        "(4 and 5 blocks; under a pipeline, stages of 3 and 4)."
    ),
    all_microbatches: bool = typer.Option(
        False, "--all-microbatches", help="Run every pipeline microbatch instead of extrapolating long "
        "schedules from two shorter ones past their warm-up."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
) -> None:
    """Per-rank peak memory of a recipe at a world size, without materializing the model.

    Any config key the estimate reads can be overridden: --section.key VALUE (one it does not read,
    e.g. --checkpoint.interval, is an error).
    """

    from titanctl.config.recipe import load_config

    # --validate also runs the real step, which reads a few more keys.
    cfg = load_config(config, ctx.args, command="estimate-memory --validate" if validate else "estimate-memory")
    from titanctl.parallel.runtime import elastic
    with heavy_imports():
        from titanctl.planning import memory

    rank = elastic.int_from_env("RANK", 0, minimum=0)
    # Every rank checks the request, so that a bad one fails everywhere before any rendezvous.
    if validate:
        memory.check_validation_world(world_size)
    plan = memory.plan_estimate(
        cfg, world_size, device=device, recipe=str(config) if config else "(defaults)", all_layers=all_layers,
        all_microbatches=all_microbatches,
    )
    estimate = memory.run_estimate(plan) if rank == 0 else None
    validation = memory.validate(plan, estimate) if validate else None
    if rank != 0:
        return
    rss = memory.rss_peak_bytes()
    if as_json:
        out = estimate.to_json()
        out["estimator_peak_rss_bytes"] = rss
        if validation is not None:
            out["validation"] = validation.to_json()
        typer.echo(json.dumps(out, indent=2))
        return
    print_report(estimate, validation, rss)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.2f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M"


def _where(phase: str, module: str) -> str:
    if module:
        return f"in {module}"
    return "outside modules (loss, root hooks)" if phase in ("forward", "backward") else "-"


def print_report(estimate, validation, rss: int) -> None:
    from rich.table import Table

    from titanctl.cli.console import wide_console
    from titanctl.safe_io import shown

    e = estimate
    out = wide_console(120)
    out.print(
        f"[bold]titanctl estimate-memory[/bold] {shown(e.recipe)}: {e.model} {e.flavor} "
        f"({_count(e.num_params)} params, "
        f"vocab {e.vocab_size:,}) on {e.world_size} ranks, layout {e.layout}",
        soft_wrap=True,
    )
    pipeline = f", {e.pipeline_microbatches} pipeline microbatches" if e.pipeline_microbatches else ""
    out.print(
        f"rank {e.rank}, for {e.target_device} (modelled with {e.modelled_on}); batch {e.local_batch_size} x "
        f"{e.seq_len} tokens, {e.mixed_precision}, {e.grad_accum_steps} microbatch(es)/step{pipeline}",
        soft_wrap=True,
    )

    where = f"step {e.peak_step}, {e.peak_phase}, {_where(e.peak_phase, e.peak_module)}"
    out.print(f"\n[bold]Peak of rank {e.rank}: {_gib(e.peak)}[/bold] ({where})", soft_wrap=True)
    table = Table()
    table.add_column("category")
    table.add_column("at the peak", justify="right")
    table.add_column("share", justify="right")
    for name, value in e.categories.items():
        if value:
            table.add_row(name, _gib(value), f"{100 * value / e.peak:.1f}%")
    table.add_row("[bold]total[/bold]", f"[bold]{_gib(e.peak)}[/bold]", "100%")
    out.print(table)

    out.print("\n[bold]Peak per phase[/bold] (step 1 creates the optimizer state; step 2 is every later step)")
    phases = Table()
    for col in ("step", "phase", "peak", "where"):
        phases.add_column(col, justify="right" if col in ("step", "peak") else "left")
    for p in e.phases:
        phases.add_row(str(p.step), p.phase, _gib(p.peak), _where(p.phase, p.module))
    out.print(phases)

    out.print("\n[bold]This rank's training state[/bold] (after the first step)")
    state = Table()
    state.add_column("tensor")
    state.add_column("bytes", justify="right")
    state.add_row("parameters (as stored)", _gib(e.parameter_bytes))
    state.add_row("gradients (after backward)", _gib(e.gradient_bytes))
    for name, value in e.optimizer_state.items():
        state.add_row(f"optimizer {name}" + (" counters" if name == "step" else ""), _gib(value))
    if e.ddp_bucket_bytes:
        state.add_row("DDP gradient buckets", _gib(e.ddp_bucket_bytes))
    out.print(state)

    out.print()
    for note in e.notes:
        out.print(f"[yellow]note:[/yellow] {note}", soft_wrap=True)
    if validation is not None:
        v = validation
        out.print(f"\n[bold]Validation[/bold]: the real step on {v.world_size} {v.device} process(es), rank 0")
        check = Table()
        for col in ("step", "estimated", "measured: tensors allocated", "estimated / measured",
                    "tracker on real tensors", "allocated, all threads"):
            check.add_column(col, justify="right")
        for step in sorted(v.allocated):
            est, mea = v.estimated.get(step, 0), v.allocated[step]
            check.add_row(str(step), _gib(est), _gib(mea), f"{est / mea:.3f}", _gib(v.tracked.get(step, 0)),
                          _gib(v.allocated_process.get(step, 0)))
        out.print(check)
    c = e.categories
    params = c["parameters"] + c["parameters (unsharded)"]
    grads = c["gradients"] + c["gradients (unsharded)"]
    other = e.peak - params - grads - c["optimizer state"] - c["activations"]
    summary = (
        f"rank {e.rank} peak {_gib(e.peak)} at step {e.peak_step} {e.peak_phase}: parameters {_gib(params)}, "
        f"gradients {_gib(grads)}, optimizer state {_gib(c['optimizer state'])}, activations "
        f"{_gib(c['activations'])}, other {_gib(other)} (estimated in {e.seconds:.1f} s, peak RSS {_gib(rss)})"
    )
    if validation is not None:
        summary += f"; measured {_gib(max(validation.allocated.values()))}, ratio {validation.ratio:.3f}"
    out.print(f"[bold]{summary}[/bold]", soft_wrap=True)

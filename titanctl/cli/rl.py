"""`titanctl rl`: reinforcement learning with verifiable rewards (GRPO, DAPO, Dr.GRPO, GSPO), alone or under
torchrun."""

from __future__ import annotations

from pathlib import Path

import typer

from titanctl.gc_pauses import heavy_imports


def rl(
    ctx: typer.Context,
    config: Path | None = typer.Option(None, "--config", help="Recipe TOML (recipes/*_grpo.toml)."),
    print_config: bool = typer.Option(False, "--print-config", help="Print the resolved config as TOML and exit."),
) -> None:
    """Improve a model on prompts with checkable answers: sample completions with the model itself, reward
    them, update it on group-relative advantages. Any config key can be overridden: --section.key VALUE."""
    from titanctl.config.recipe import load_config, to_toml

    cfg = load_config(config, ctx.args, command="rl")
    if print_config:
        typer.echo(to_toml(cfg))
        return
    with heavy_imports():
        from titanctl.rl.loop import RLTrainer

    RLTrainer(cfg).train()

"""`titanctl rl`: reinforcement learning with verifiable rewards (GRPO, DAPO, Dr.GRPO, GSPO), alone or under
torchrun."""

from __future__ import annotations

from pathlib import Path

import typer

from titanctl.cli.train import run_recipe


def rl(
    ctx: typer.Context,
    config: Path | None = typer.Option(None, "--config", help="Recipe TOML (recipes/*_grpo.toml)."),
    print_config: bool = typer.Option(False, "--print-config", help="Print the resolved config as TOML and exit."),
) -> None:
    """Improve a model on prompts with checkable answers: sample completions with the model itself, reward
    them, update it on group-relative advantages. Any config key can be overridden: --section.key VALUE."""
    run_recipe("rl", config, ctx.args, print_config)

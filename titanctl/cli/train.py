"""`titanctl train`: pre-train a recipe, alone or under torchrun."""

from __future__ import annotations

from pathlib import Path

import typer

from titanctl.gc_pauses import heavy_imports


def train(
    ctx: typer.Context,
    config: Path | None = typer.Option(None, "--config", help="Recipe TOML (recipes/*.toml)."),
    print_config: bool = typer.Option(False, "--print-config", help="Print the resolved config as TOML and exit."),
) -> None:
    """Train the recipe's model (pre-training, chat SFT, LoRA). Any config key can be overridden:
    --section.key VALUE."""
    from titanctl.config.recipe import load_config, to_toml

    cfg = load_config(config, ctx.args, command="train")
    if print_config:
        typer.echo(to_toml(cfg))
        return
    with heavy_imports():
        from titanctl.train.trainer import Trainer

    Trainer(cfg).train()

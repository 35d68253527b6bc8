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
    run_recipe("train", config, ctx.args, print_config)


def run_recipe(command: str, config: Path | None, overrides: list[str], print_config: bool) -> None:
    """Load the recipe with its overrides (refusing those ``command`` does not read), then print it or run it:
    train's Trainer, or rl's RLTrainer."""
    from titanctl.config.recipe import load_config, to_toml

    cfg = load_config(config, overrides, command=command)
    if print_config:
        typer.echo(to_toml(cfg))
        return
    with heavy_imports():
        if command == "rl":
            from titanctl.rl.loop import RLTrainer as Trainer
        else:
            from titanctl.train.trainer import Trainer

    Trainer(cfg).train()

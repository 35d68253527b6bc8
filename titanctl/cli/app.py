"""The `titanctl` binary: one Typer app, one module per subcommand.

Subcommand modules import torch inside their functions, so `titanctl --help` is instant.
"""

from __future__ import annotations

import difflib
import math
import sys

import click
import typer
from typer.core import TyperCommand, TyperGroup

from titanctl.cli import console
from titanctl.errors import ConfigError, TitanError

try:  # Typer >= 0.26 vendors click, with exception classes of its own; older Typers run on click itself
    from typer import _click as typer_click
except ImportError:
    typer_click = click

# Usage errors from either click hierarchy: Typer's vendored copy raises its own classes.
_CLICK_ERRORS = (typer_click.exceptions.ClickException, click.ClickException)
_EXITS = (typer.Exit, click.exceptions.Exit)
# Raised after printing the help for a bare `titanctl` (click >= 8.2).
_NO_ARGS_IS_HELP = getattr(typer_click.exceptions, "NoArgsIsHelpError", ())
_ABORTS = (typer.Abort, click.exceptions.Abort, KeyboardInterrupt)


class _Command(TyperCommand):
    """A subcommand whose float options must be finite: Typer's ranges let inf (and, without a
    range, nan) through, and no option of titanctl means anything with them."""

    def parse_args(self, ctx, args):
        rest = super().parse_args(ctx, args)
        for param in self.params:
            value = ctx.params.get(param.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise typer.BadParameter(f"{value} is not a finite number", ctx=ctx, param=param)
        return rest


class _Group(TyperGroup):
    """Names the valid commands when a mistyped one is not close to any (Typer suggests close ones)."""

    def resolve_command(self, ctx, args):
        try:
            return super().resolve_command(ctx, args)
        except typer_click.exceptions.UsageError as e:
            if args and "Did you mean" not in e.message:
                close = difflib.get_close_matches(args[0], list(self.commands), n=1, cutoff=0.3)
                hint = f"did you mean '{close[0]}'? " if close else ""
                e.message = f"{e.message.rstrip('.')}; {hint}commands: {', '.join(self.commands)}"
            raise


app = typer.Typer(
    name="titanctl",
    cls=_Group,
    help="Pre-train and fine-tune decoder LLMs with PyTorch, from one CPU to thousands of GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


@app.callback()
def _global_options(
    debug: bool = typer.Option(
        False, "--debug", help="Show the full traceback of an error (put it before the subcommand)."
    ),
) -> None:
    """Pre-train and fine-tune decoder LLMs with PyTorch, from one CPU to thousands of GPUs."""
    # main() takes --debug out of the arguments before parsing (errors raised while parsing need
    # it too); the option is declared here so that `titanctl --help` lists it.


# Commands that accept `--section.key VALUE` config overrides after their own options.
OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}


def _register() -> None:
    from titanctl.cli import (
        convert,
        download_tokenizer,
        estimate_memory,
        infer_tp,
        inspect_trace,
        plan,
        profile,
        rl,
        train,
    )

    def command(name: str, fn, **kwargs) -> None:
        app.command(name, cls=_Command, **kwargs)(fn)

    command("train", train.train, context_settings=OVERRIDES)
    command("rl", rl.rl, context_settings=OVERRIDES)
    command("download-tokenizer", download_tokenizer.download_tokenizer)
    command("convert-checkpoint", convert.convert, context_settings=OVERRIDES)
    command("convert", convert.convert, help="Alias of convert-checkpoint.", context_settings=OVERRIDES)
    command("estimate-memory", estimate_memory.estimate_memory, context_settings=OVERRIDES)
    command("plan", plan.plan)
    command("profile", profile.profile, context_settings=OVERRIDES)
    command("inspect-trace", inspect_trace.inspect_trace)
    command("infer-tp", infer_tp.infer_tp, context_settings=OVERRIDES)


_register()


def _strip_debug(argv: list[str]) -> tuple[list[str], bool]:
    """Take --debug out of the arguments, wherever it is (as it always was)."""
    kept = [a for a in argv if a != "--debug"]
    return kept, len(kept) != len(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI: a TitanError or a usage error becomes one red line and exit code 2 (traceback
    with --debug)."""
    argv, debug = _strip_debug(list(sys.argv[1:] if argv is None else argv))
    try:
        code = app(args=argv, prog_name="titanctl", standalone_mode=False)
    except _NO_ARGS_IS_HELP:
        code = 2  # the help was printed; like click, no command at all is a usage error
    except (TitanError, *_CLICK_ERRORS) as e:
        if debug:
            raise
        # A usage error is the same on every rank, as a config error is.
        console.report(e if isinstance(e, TitanError) else ConfigError(e.format_message()))
        code = 2
    except _EXITS as e:
        code = e.exit_code
    except _ABORTS:
        console.error("interrupted")
        code = 130
    console.finish(code or 0)

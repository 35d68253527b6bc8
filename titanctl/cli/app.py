"""The `titanctl` binary: one Typer app, one module per subcommand.

Subcommand modules import torch inside their functions, so `titanctl --help` is instant.
"""

from __future__ import annotations

import sys

import click
import typer

from titanctl.cli import console
from titanctl.errors import TitanError

app = typer.Typer(
    name="titanctl",
    help="Pre-train Llama 3.1 models with PyTorch, from one CPU to thousands of GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

# Commands that accept `--section.key VALUE` config overrides after their own options.
OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}


def _register() -> None:
    from titanctl.cli import (
        convert,
        download_tokenizer,
        estimate_memory,
        infer_tp,
        inspect_trace,
        profile,
        train,
    )

    app.command("train", context_settings=OVERRIDES)(train.train)
    app.command("download-tokenizer")(download_tokenizer.download_tokenizer)
    app.command("convert-checkpoint")(convert.convert)
    app.command("convert", help="Alias of convert-checkpoint.")(convert.convert)
    app.command("estimate-memory", context_settings=OVERRIDES)(estimate_memory.estimate_memory)
    app.command("profile", context_settings=OVERRIDES)(profile.profile)
    app.command("inspect-trace")(inspect_trace.inspect_trace)
    app.command("infer-tp", context_settings=OVERRIDES)(infer_tp.infer_tp)


_register()


def main(argv: list[str] | None = None) -> None:
    """Run the CLI: a TitanError becomes one red line and exit code 2 (traceback with --debug)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if debug:
        argv.remove("--debug")
    try:
        code = app(args=argv, prog_name="titanctl", standalone_mode=False)
    except TitanError as e:
        if debug:
            raise
        console.report(e)
        code = 2
    except click.exceptions.Exit as e:
        code = e.exit_code
    except click.ClickException as e:
        e.show()
        code = 2
    except (click.exceptions.Abort, KeyboardInterrupt):
        console.error("interrupted")
        code = 130
    console.finish(code or 0)

"""Console output shared by the subcommands."""

from __future__ import annotations

import os
import signal
import sys

from rich.console import Console

from titanctl.errors import ConfigError, ParallelError, TitanError
from titanctl.parallel.runtime import elastic, peers
from titanctl.safe_io import shown

err = Console(stderr=True, highlight=False, emoji=False)


def wide_console(min_width: int) -> Console:
    """stdout; piped or captured, at least ``min_width`` columns, so tables are not squeezed into 80."""
    out = Console(highlight=False, emoji=False)
    if not out.is_terminal:
        out = Console(highlight=False, emoji=False, width=max(out.width, min_width))
    return out


class ByteProgress:
    """A progress bar in bytes on stderr (with the tensor being written), drawn only on a terminal:
    a ``titanctl.checkpoint.convert.ProgressSink`` (not imported here: this module loads with --help)."""

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[tensor]}", style="dim"),
            console=err,
            transient=True,
            disable=not err.is_terminal,
        )
        self.task = None

    def start(self, total_bytes: int, description: str) -> None:
        self.progress.start()
        self.task = self.progress.add_task(description, total=total_bytes, tensor="")

    def advance(self, name: str, nbytes: int) -> None:
        self.progress.update(self.task, advance=nbytes, tensor=shown(name))  # a name from the checkpoint

    def stop(self) -> None:
        self.progress.stop()


def error(message: str) -> None:
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    err.print(f"[bold red]error:[/bold red] {shown(prefix + message)}", soft_wrap=True)


def report(e: TitanError) -> None:
    """A user error, as one line on stderr (and in torchrun's end-of-job summary).

    Under torchrun, an error that every rank meets alike (the config, the layout) is printed once,
    by rank 0; the other ranks wait until rank 0 has said it (or torchrun stops them), then exit with the
    same code, so that the error is not cut short by torchrun's SIGTERM; a rank whose error rank 0 did not
    meet says it itself.
    """
    alike = isinstance(e, (ConfigError, ParallelError))  # every rank meets it, before any collective
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    quiet = alike and rank != "0" and world != "1"
    if quiet:
        # Before the error file: from then on this rank may be the root cause torchrun names, and it must
        # not be named as stopped by SIGTERM (exit -15) when torchrun stops it after rank 0 has left.
        signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
    elastic.record_failure(str(e), first_hand=alike)
    if not quiet:
        error(str(e))
    peers.publish_failure(str(e))  # after the line: a rank waiting for it leaves once it is said
    if quiet and not peers.wait_for_failure_of(0, _QUIET_RANKS_WAIT_S):
        error(str(e))  # rank 0 did not meet it: this rank's own say


_QUIET_RANKS_WAIT_S = 30.0  # at most: rank 0 meets the same error as soon as it has started


def finish(code: int) -> None:
    """Exit; a worker under torchrun tears its process group down first.

    gloo workers that built a DeviceMesh abort at interpreter exit now and then (torch 2.13:
    "terminate called without an active exception", SIGABRT, in up to 1 of 4 two-rank runs after
    all work was done; never when the process group is destroyed first and the process leaves
    with os._exit): flush, destroy the group, then leave with os._exit. Under torchrun a rank leaves
    with os._exit even before any group formed: interpreter shutdown restores SIGTERM's default action,
    and torchrun's SIGTERM to the other ranks once one has exited then killed a rank that was leaving
    with exit code 2 (torchrun's summary said -15, SIGTERM, for a rank that had refused the config).
    """
    dist = sys.modules.get("torch.distributed")  # never import torch just to exit
    grouped = dist is not None and dist.is_available() and dist.is_initialized()
    if grouped or elastic.under_torchrun():
        sys.stdout.flush()
        sys.stderr.flush()
        if grouped:
            dist.destroy_process_group()
        os._exit(code)
    sys.exit(code)

"""Console output shared by the subcommands."""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.markup import escape

err = Console(stderr=True, highlight=False)


def error(message: str) -> None:
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    err.print(f"[bold red]error:[/bold red] {escape(prefix + message)}", soft_wrap=True)


def finish(code: int) -> None:
    """Exit; a worker under torchrun tears its process group down first.

    gloo workers that built a DeviceMesh abort at interpreter exit now and then (torch 2.13:
    "terminate called without an active exception", SIGABRT, in up to 1 of 4 two-rank runs after
    all work was done; never when the process group is destroyed first and the process leaves
    with os._exit): flush, destroy the group, then leave with os._exit.
    """
    dist = sys.modules.get("torch.distributed")  # never import torch just to exit
    if dist is not None and dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        dist.destroy_process_group()
        os._exit(code)
    sys.exit(code)

"""Console output shared by the subcommands."""

from __future__ import annotations

import os
import sys

from rich.console import Console

err = Console(stderr=True, highlight=False)


def error(message: str) -> None:
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    err.print(f"[bold red]error:[/bold red] {prefix}{message}", soft_wrap=True)


def finish(code: int) -> None:
    """Exit; a worker under torchrun tears its process group down first.

    gloo workers that built a DeviceMesh abort at interpreter exit now and then
    (shared/FACTS.md, "Exit abort"): flush, destroy the group, then leave with os._exit.
    """
    dist = sys.modules.get("torch.distributed")  # never import torch just to exit
    if dist is not None and dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        dist.destroy_process_group()
        os._exit(code)
    sys.exit(code)

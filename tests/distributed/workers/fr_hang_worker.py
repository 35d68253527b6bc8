"""A real collective hang on gloo, for the Flight Recorder test.

Launched by torchrun with 3 processes. Every rank runs a few collectives on the default group
and on a subgroup; then rank 1 skips an all_reduce that the others enter. A watchdog dumps each
rank's Flight Recorder buffer after WATCHDOG_S; the skipping rank dumps after its own wait.

Usage: torchrun --standalone --nproc_per_node 3 fr_hang_worker.py DUMP_FOLDER
"""

import os
import sys
from datetime import timedelta
from pathlib import Path

SKIPPING_RANK = 1
WATCHDOG_S = 1.0


def main(folder: Path) -> None:
    from titanctl.parallel.runtime import hang_watchdog

    hang_watchdog.enable(buffer_size=64)  # before the process group exists

    import torch
    import torch.distributed as dist

    # The group timeout is a backstop only: the watchdog fires long before it.
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    rank = dist.get_rank()
    pair = dist.new_group([0, 1], group_desc="pair")  # a second group, to check groups stay apart

    dumper = hang_watchdog.DumpOnce(folder, rank)
    watchdog = hang_watchdog.CollectiveWatchdog(WATCHDOG_S, dumper)

    x = torch.ones(1024)
    dist.all_reduce(x)  # #1
    dist.broadcast(x, src=0)  # #2
    if rank in (0, 1):
        dist.all_reduce(torch.ones(8), group=pair)
    dist.all_reduce(x)  # #3
    dist.broadcast(x, src=0)  # #4

    try:
        with watchdog.watch("step 1"):
            if rank == SKIPPING_RANK:
                watchdog.fired.wait(30)  # the bug: this rank never calls the all_reduce
            else:
                dist.all_reduce(x)  # #5: blocks, rank 1 never joins
    except Exception as e:  # a peer left first: the collective fails instead of hanging
        print(f"[rank {rank}] collective failed: {type(e).__name__}", file=sys.stderr, flush=True)
    dumper("step 1")  # no-op if the watchdog dumped already; waits for a dump in progress
    sys.stdout.flush()
    sys.stderr.flush()
    dist.destroy_process_group()
    os._exit(0)  # never run the interpreter's teardown after gloo (see titanctl.cli.console.finish)


if __name__ == "__main__":
    main(Path(sys.argv[1]))

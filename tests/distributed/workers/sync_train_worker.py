"""Train under torchrun with every host read of a tensor recorded (see host_syncs.py), the log
windows timed here rather than by the Trainer, and, with float8 on, what FSDP's float8 settings did
(see float8_probe.py).

    torchrun ... sync_train_worker.py --job.dump_folder OUT [--section.key VALUE ...]

Writes metrics.jsonl as usual (rank 0) and on every rank r:
- OUT/host_syncs_rank{r}.json: {"allowed": calls made by the log-step functions,
  "first_step": [calls in the first step], "violations": [other calls, with call sites]};
- OUT/log_windows_rank{r}.json: [{"step": the logged step, "seconds": wall time of its window}], a
  window running from the end of the process's first step (which the Trainer times apart: compile,
  warm-up), or from the end of the previous log row, to the end of this row's host sync (reading the
  losses: the moment the Trainer reads its own clock);
- OUT/float8_rank{r}.json with float8.enable_float8_linear: Float8Probe.report().
"""

import json
import sys
import time
from pathlib import Path

from tests.distributed.workers.float8_probe import Float8Probe
from tests.distributed.workers.host_syncs import record_host_syncs
from titanctl.cli.console import finish
from titanctl.config.recipe import load_config
from titanctl.train.trainer import Trainer


def time_log_windows(trainer: Trainer) -> list[dict]:
    """Wrap the end of the first step, every read of the losses and every _log call of ``trainer`` with
    this worker's own clock."""
    windows: list[dict] = []
    started: list[float] = []
    losses_read: list[float] = []
    first_step_done, read_losses, log = trainer._first_step_done, trainer.read_losses, trainer._log

    def timed_first_step_done(*args, **kwargs):
        try:
            return first_step_done(*args, **kwargs)
        finally:
            started.append(time.perf_counter())  # the first step, and what follows it, is in no window

    def timed_read_losses(*args, **kwargs):
        try:
            return read_losses(*args, **kwargs)
        finally:
            # Where the Trainer ends its window too: entering the hang watchdog before _log wakes its
            # thread, which may hold the GIL for a switch interval (5 ms) before _log runs.
            losses_read.append(time.perf_counter())

    def timed_log(*args, **kwargs):
        windows.append({"step": trainer.step, "seconds": losses_read[-1] - started[-1]})
        try:
            return log(*args, **kwargs)
        finally:
            started.append(time.perf_counter())

    trainer._first_step_done, trainer.read_losses, trainer._log = timed_first_step_done, timed_read_losses, timed_log
    return windows


def train_probed(trainer: Trainer) -> None:
    """``trainer.train()`` with the records this module's docstring lists."""
    cfg = trainer.cfg
    windows = time_log_windows(trainer)
    probe = Float8Probe(trainer) if cfg.float8.enable_float8_linear else None
    with record_host_syncs() as syncs:
        trainer.train()
    out = Path(cfg.job.dump_folder)
    out.mkdir(parents=True, exist_ok=True)
    rank = trainer.env.rank
    record = {"allowed": syncs.allowed, "first_step": syncs.first_step, "violations": syncs.violations}
    (out / f"host_syncs_rank{rank}.json").write_text(json.dumps(record))
    (out / f"log_windows_rank{rank}.json").write_text(json.dumps(windows))
    if probe is not None:
        (out / f"float8_rank{rank}.json").write_text(json.dumps(probe.report()))
        probe.close()


def main() -> None:
    train_probed(Trainer(load_config(None, sys.argv[1:])))


if __name__ == "__main__":
    main()
    finish(0)  # destroy the process group, then os._exit (gloo can abort at a plain exit)

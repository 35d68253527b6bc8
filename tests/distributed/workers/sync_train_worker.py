"""Train under torchrun with every host read of a tensor recorded (see host_syncs.py).

    torchrun ... sync_train_worker.py --job.dump_folder OUT [--section.key VALUE ...]

Writes metrics.jsonl as usual (rank 0) and OUT/host_syncs_rank{r}.json on every rank:
{"allowed": calls made by the log-step functions, "first_step": [calls in the first step],
"violations": [other calls, with call sites]}.
"""

import json
import sys
from pathlib import Path

from tests.distributed.workers.host_syncs import record_host_syncs
from titanctl.cli.console import finish
from titanctl.config.loader import load_config
from titanctl.train.trainer import Trainer


def main() -> None:
    cfg = load_config(None, sys.argv[1:])
    trainer = Trainer(cfg)
    with record_host_syncs() as syncs:
        trainer.train()
    out = Path(cfg.job.dump_folder)
    out.mkdir(parents=True, exist_ok=True)
    record = {"allowed": syncs.allowed, "first_step": syncs.first_step, "violations": syncs.violations}
    (out / f"host_syncs_rank{trainer.env.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
    finish(0)  # destroy the process group, then os._exit (gloo can abort at a plain exit)

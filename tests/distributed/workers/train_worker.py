"""Train under torchrun and also save this rank's initial weights, gathered to full tensors.

    torchrun ... train_worker.py --job.dump_folder OUT [--section.key VALUE ...]

Writes OUT/init_rank{r}.pt ({canonical name: full fp32 tensor}) before the first step, and
metrics.jsonl from training as usual.
"""

import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from titanctl.cli.console import finish
from titanctl.config.recipe import load_config
from titanctl.parallel.layouts.weight_init import canonical_name
from titanctl.train.trainer import Trainer


def main() -> None:
    cfg = load_config(None, sys.argv[1:])
    trainer = Trainer(cfg)
    weights = {}
    for part in trainer.model_parts:
        for name, param in part.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            weights[canonical_name(name)] = full.float().cpu().clone()
    out = Path(cfg.job.dump_folder)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(weights, out / f"init_rank{trainer.env.rank}.pt")
    trainer.train()


if __name__ == "__main__":
    main()
    finish(0)  # destroy the process group, then os._exit (see titanctl.cli.console.finish: gloo aborts at exit otherwise)

"""Train under torchrun like `titanctl train`, with test instrumentation for checkpoint tests.

    torchrun ... ckpt_worker.py [--test-write-delay S] [--test-resume-from K] --job.dump_folder OUT \
        [--section.key VALUE ...]

Always writes OUT/samples_rank{r}.jsonl: per step, this rank's loader position before the step and a
hash of every sequence it trained on (to prove no sample is repeated or skipped across a resume).
  --test-write-delay S   every DCP write waits S seconds first (a wide window for killing mid-save)
  --test-resume-from K   after training, resume in this same process group from step-K: copy it to
                         OUT/resumed/checkpoint/ and train again with job.dump_folder OUT/resumed
  --test-fail-at A:R:S   in torchrun attempt A (TORCHELASTIC_RESTART_COUNT), rank R raises a RuntimeError
                         when it starts step S (a crash inside training, for restart tests)
  --test-step-delay S    every step waits S seconds first (a slower run, for a node to join it in time)
  --test-alone-wait S    torchft, under scripts/ft_local.py (which restarts a killed group once): a step
                         trained while a replica group is down first waits, at most S seconds, until some
                         other group's log shows it started again and is about to join its first quorum,
                         so that the restarted group rejoins at a step that does not depend on the load
  --test-start-together S  torchft, under scripts/ft_local.py: before its first step a group waits, at most
                         S seconds, until every group's log shows its Manager started (it heartbeats), so
                         that the first quorum holds every group however unevenly the groups start
  --test-hold-for-kill G:S  torchft, under scripts/ft_local.py --kill-group G --kill-at-step S: group G's
                         first start waits (at most 120 s) before step S + 1 for the kill, so that it dies
                         after step S however loaded the machine (a started step could reach the next sync)
  --test-dump-final      after training, write OUT/final_rank{r}.pt: every parameter gathered whole
"""

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from tests.fork_server import hand_over

if __name__ == "__main__":  # not when a test imports the module
    hand_over()  # run as a fork of the test session's server, when it has one

from titanctl.gc_pauses import heavy_imports

with heavy_imports():
    import torch.distributed as dist

    from titanctl.cli.console import finish
    from titanctl.config.recipe import load_config
    from titanctl.train.trainer import Trainer


def log_samples(trainer: Trainer, out: Path) -> None:
    sink = open(out / f"samples_rank{trainer.env.rank}.jsonl", "a", buffering=1)
    loader = trainer.loader
    next_step = loader.next_step

    def logged():
        before = loader.samples_consumed
        microbatches = next_step()
        rows = [
            hashlib.sha1(inputs[i].numpy().tobytes() + labels[i, -1:].numpy().tobytes()).hexdigest()[:16]
            for inputs, labels in microbatches
            for i in range(len(inputs))
        ]
        sink.write(json.dumps({"step": trainer.step + 1, "consumed_before": before, "dp_rank": loader.dp_rank,
                               "rows": rows}) + "\n")
        return microbatches

    loader.next_step = logged


def fail_at(trainer: Trainer, spec: str) -> None:
    attempt, rank, step = (int(x) for x in spec.split(":"))
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != attempt or trainer.env.rank != rank:
        return
    next_step = trainer.loader.next_step

    def failing():
        if trainer.step + 1 == step:
            raise RuntimeError(f"injected failure at step {step}")
        return next_step()

    trainer.loader.next_step = failing


def slow_writes(seconds: float) -> None:
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    write_data = _FileSystemWriter.write_data

    def delayed(self, plan, planner):
        time.sleep(seconds)
        return write_data(self, plan, planner)

    _FileSystemWriter.write_data = delayed


def slow_steps(trainer: Trainer, seconds: float) -> None:
    next_step = trainer.loader.next_step

    def delayed():
        time.sleep(seconds)
        return next_step()

    trainer.loader.next_step = delayed


def wait_while_a_group_is_down(trainer: Trainer, seconds: float) -> None:
    ft = trainer.cfg.fault_tolerance
    # Each start of a group prints "step N: warming up..." once, just before its first quorum.
    logs = group_logs(trainer)
    next_step = trainer.loader.next_step

    def restarted() -> bool:
        return any(log.exists() and log.read_text().count(": warming up...") >= 2 for log in logs)

    def waiting():  # called after the step's quorum: the Manager knows who is live
        if trainer.ft.manager.num_participants() < ft.group_size and not restarted():
            deadline = time.monotonic() + seconds
            while not restarted() and time.monotonic() < deadline:
                time.sleep(0.05)
        return next_step()

    trainer.loader.next_step = waiting


def group_logs(trainer: Trainer) -> list[Path]:
    """Every other group's console: ft_local.py writes group j's to DIR/replica_j.log."""
    ft = trainer.cfg.fault_tolerance
    run_dir = Path(trainer.cfg.job.dump_folder).parent
    return [run_dir / f"replica_{j}.log" for j in range(ft.group_size) if j != ft.replica_id]


def start_together(trainer: Trainer, seconds: float) -> None:
    # Each start of group j prints "replica group j of" once its Manager heartbeats to the Lighthouse,
    # which from then on holds every quorum for it (its join timeout).
    logs = group_logs(trainer)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(
            log.exists() and f"replica group {log.stem.removeprefix('replica_')} of" in log.read_text() for log in logs):
        time.sleep(0.05)


def hold_for_kill(trainer: Trainer, spec: str) -> None:
    group, step = (int(x) for x in spec.split(":"))
    if trainer.cfg.fault_tolerance.replica_id != group or trainer.ft.restored_step > 0:  # not its first start
        return
    next_step = trainer.loader.next_step

    def held():
        if trainer.step == step:
            time.sleep(120)  # ft_local's SIGKILL ends it
        return next_step()

    trainer.loader.next_step = held


def dump_final(trainer: Trainer, out: Path) -> None:
    from torch.distributed.tensor import DTensor

    from titanctl.parallel.layouts.weight_init import canonical_name

    weights = {canonical_name(n): (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
               for part in trainer.model_parts for n, p in part.named_parameters()}
    import torch

    torch.save(weights, out / f"final_rank{trainer.env.rank}.pt")


def run(cfg, fail: str | None = None, step_delay: str | None = None, alone_wait: str | None = None,
        final: bool = False, together: str | None = None, hold: str | None = None) -> Trainer:
    out = Path(cfg.job.dump_folder)
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg)
    log_samples(trainer, out)
    if fail:
        fail_at(trainer, fail)
    if step_delay:
        slow_steps(trainer, float(step_delay))
    if alone_wait:
        wait_while_a_group_is_down(trainer, float(alone_wait))
    if together:
        start_together(trainer, float(together))
    if hold:
        hold_for_kill(trainer, hold)
    trainer.train()
    if final:
        dump_final(trainer, out)
    return trainer


def pop_option(args: list[str], name: str) -> str | None:
    if name not in args:
        return None
    i = args.index(name)
    value = args[i + 1]
    del args[i : i + 2]
    return value


def main() -> None:
    args = sys.argv[1:]
    delay = pop_option(args, "--test-write-delay")
    resume_from = pop_option(args, "--test-resume-from")
    fail = pop_option(args, "--test-fail-at")
    step_delay = pop_option(args, "--test-step-delay")
    alone_wait = pop_option(args, "--test-alone-wait")
    together = pop_option(args, "--test-start-together")
    hold = pop_option(args, "--test-hold-for-kill")
    final = "--test-dump-final" in args
    if final:
        args.remove("--test-dump-final")
    if delay:
        slow_writes(float(delay))
    cfg = load_config(None, args)
    trainer = run(cfg, fail, step_delay, alone_wait, final, together, hold)
    if resume_from:
        out = Path(cfg.job.dump_folder)
        again = out / "resumed"
        if trainer.env.rank == 0:
            source = out / cfg.checkpoint.folder / f"step-{resume_from}"
            shutil.copytree(source, again / cfg.checkpoint.folder / source.name)
        if dist.is_initialized():
            dist.barrier()
        cfg2 = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, dump_folder=str(again)))
        run(cfg2)


if __name__ == "__main__":
    main()
    finish(0)  # destroy the process group, then os._exit (see titanctl.cli.console.finish: gloo aborts at exit otherwise)

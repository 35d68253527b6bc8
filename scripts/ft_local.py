"""Fault-tolerant training on one machine: torchft's Lighthouse and one torchrun per replica group.

    python scripts/ft_local.py --groups G --procs-per-group P --dump-folder DIR \\
        [--kill-group I --kill-at-step S] -- <titanctl train options>

Group i trains into DIR/replica_i (its console in DIR/replica_i.log). With --kill-group, once group I
logs step S, every process of that group (torchrun and its ranks) gets SIGKILL, and the group is
started again with the same command: it rejoins by copying a live peer's state (docs/fault-tolerance.md).
Waits for every group; exits 1 if any group's last run failed. DIR/ft_events.jsonl records when each
group's rows appeared, the kill, the restart and each group's exit (benchmarks/ft_recovery.py reads it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Group:
    index: int
    cmd: list[str]
    folder: Path
    log: Path
    proc: subprocess.Popen | None = None
    seen_rows: int = 0
    steps: list[int] = field(default_factory=list)
    exited: bool = False

    def start(self, env: dict[str, str]) -> None:
        with open(self.log, "a") as log:
            self.exited = False
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def new_steps(self) -> list[int]:
        """Steps of the rows group wrote since the last call."""
        path = self.folder / "metrics.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        complete = [line for line in lines if line.endswith("}")]
        fresh = complete[self.seen_rows:]
        self.seen_rows = len(complete)
        return [json.loads(line)["step"] for line in fresh]


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process under it (torchrun's workers run in sessions of their own)."""
    tree, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                tree.append(int(stat.parent.name))
                frontier.append(int(stat.parent.name))
    return tree


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL a group's torchrun and all its ranks at once: a replica group lost as a whole."""
    for pid in process_tree(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def group_command(args, i: int, train_args: list[str]) -> list[str]:
    target = [args.worker] if args.worker else ["-m", "titanctl", "train"]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.procs_per_group}",
        *target, *train_args,
        "--fault_tolerance.enable", "--fault_tolerance.replica_id", str(i),
        "--fault_tolerance.group_size", str(args.groups),
        "--job.dump_folder", str(args.dump_folder / f"replica_{i}"),
    ]


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ours, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, required=True, help="replica groups")
    p.add_argument("--procs-per-group", type=int, required=True, help="ranks (processes) per group")
    p.add_argument("--dump-folder", type=Path, required=True, help="group i writes DIR/replica_i")
    p.add_argument("--kill-group", type=int, help="the group to kill")
    p.add_argument("--kill-at-step", type=int, help="kill it when it has logged this step")
    p.add_argument("--min-replicas", type=int, default=1, help="the Lighthouse's quorum size (default 1)")
    p.add_argument("--join-timeout-ms", type=int, default=60000,
                   help="how long a quorum waits for a group that heartbeats but has not joined yet")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=2000, help="a silent group is dropped after this")
    p.add_argument("--worker", help="a script that takes titanctl train's options, run instead of titanctl train")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before every group is killed")
    args = p.parse_args(ours)
    if args.groups < 1 or args.procs_per_group < 1:
        p.error("--groups and --procs-per-group must be >= 1")
    if (args.kill_group is None) != (args.kill_at_step is None):
        p.error("--kill-group and --kill-at-step go together")
    if args.kill_group is not None and not 0 <= args.kill_group < args.groups:
        p.error(f"--kill-group must be in 0..{args.groups - 1}")
    return args, train_args


def run(argv: list[str]) -> int:
    args, train_args = parse(argv)
    from torchft.coordination import LighthouseServer

    args.dump_folder.mkdir(parents=True, exist_ok=True)
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse.address(),
           "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}  # the checkout first, once
    events = open(args.dump_folder / "ft_events.jsonl", "a", buffering=1)

    def event(**what) -> None:
        events.write(json.dumps({"time": time.time(), **what}) + "\n")

    groups = [Group(i, group_command(args, i, train_args), args.dump_folder / f"replica_{i}",
                    args.dump_folder / f"replica_{i}.log") for i in range(args.groups)]
    print(f"lighthouse {lighthouse.address()}; {args.groups} groups x {args.procs_per_group} processes", flush=True)
    for g in groups:
        g.start(env)
        event(group=g.index, what="start")
    pending_kill = args.kill_group
    deadline = time.monotonic() + args.timeout
    try:
        while not all(g.exited for g in groups):
            for g in groups:
                if g.proc.poll() is not None and not g.exited:
                    g.exited = True
                    event(group=g.index, what="exit", code=g.proc.returncode)
                for step in g.new_steps():
                    event(group=g.index, what="step", step=step)
                    if g.index == pending_kill and step >= args.kill_at_step:
                        kill(g.proc)
                        event(group=g.index, what="kill", step=step)
                        print(f"killed replica group {g.index} at step {step}; restarting it", flush=True)
                        g.start(env)
                        event(group=g.index, what="restart")
                        pending_kill = None
            if time.monotonic() > deadline:
                print(f"timed out after {args.timeout} s", file=sys.stderr)
                break
            time.sleep(0.02)
    finally:
        for g in groups:
            if g.proc.poll() is None:
                kill(g.proc)
            for step in g.new_steps():  # its last rows
                event(group=g.index, what="step", step=step)
        lighthouse.shutdown()
        events.close()
    failed = [g.index for g in groups if g.proc.returncode != 0]
    for g in groups:
        print(f"replica group {g.index}: exit {g.proc.returncode} ({g.log})", flush=True)
    return 1 if failed or pending_kill is not None else 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))

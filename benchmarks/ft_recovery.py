"""Recovery without a restart (torchft) against a whole-job restart (torchrun --max-restarts), measured.

The debug recipe, the same global batch in both:
- torchft: scripts/ft_local.py, 2 replica groups of 1 process; group 1 is SIGKILLed once it logged
  step --kill-at and started again. Measured: the seconds from the kill to the survivor's next step,
  the seconds from the restart to the healed group's first step (process start, imports, model build,
  the peer's state over torchft's checkpoint transport, that step), and the steps lost (re-trained).
- whole job: torchrun --nproc_per_node 2 --max-restarts 1 (FSDP 2), a checkpoint every
  --checkpoint-interval steps; rank 1 is SIGKILLed once step --kill-at is logged. Measured: the seconds
  from the kill to the first new step, and the steps the restarted job trained again.

    PYTHONPATH=. .venv/bin/python benchmarks/ft_recovery.py [--steps 40] [--kill-at 12] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from ft_local import process_tree  # noqa: E402  (the launcher's own process walk)


def train_options(args) -> list[str]:
    return [
        "--config", "recipes/llama3_debug.toml", "--training.steps", str(args.steps),
        "--training.seq_len", str(args.seq_len), "--training.local_batch_size", "4",
        "--training.global_batch_size", "8", "--metrics.log_freq", "1",
        "--checkpoint.enable_checkpoint", "--checkpoint.interval", str(args.checkpoint_interval),
        "--checkpoint.keep_latest_k", "2",
    ]


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO)}


def rows(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    except (OSError, ValueError):
        return []


def torchft_run(args, out: Path) -> dict:
    cmd = [sys.executable, str(REPO / "scripts" / "ft_local.py"), "--groups", "2", "--procs-per-group", "1",
           "--dump-folder", str(out), "--kill-group", "1", "--kill-at-step", str(args.kill_at), "--",
           *train_options(args)]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"ft_local failed ({proc.returncode}); see {out}/replica_*.log\n{proc.stdout[-2000:]}")
    events = [json.loads(line) for line in (out / "ft_events.jsonl").read_text().splitlines()]
    kill = next(e for e in events if e["what"] == "kill")
    restart = next(e for e in events if e["what"] == "restart")
    survivor_next = next(e for e in events if e["what"] == "step" and e["group"] == 0 and e["time"] > kill["time"])
    healed_first = next(e for e in events if e["what"] == "step" and e["group"] == 1 and e["time"] > restart["time"])
    survivor = rows(out / "replica_0" / "metrics.jsonl")
    healed = [r for r in rows(out / "replica_1" / "metrics.jsonl") if "heal_seconds" in r]
    return {
        "kill_to_next_step_s": survivor_next["time"] - kill["time"],
        "restart_to_healed_s": healed_first["time"] - restart["time"],
        "heal_transfer_s": healed[0]["heal_seconds"] if healed else None,
        "survivor_lost_steps": sum(r["lost_steps"] for r in survivor),
        "healed_group_missed_steps": healed[0]["missed_steps"] if healed else None,
    }


def whole_job_run(args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "-m", "titanctl", "train", *train_options(args), "--job.dump_folder", str(out)]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / "whole_job.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    metrics, killed_at, last_before, next_step_s = out / "metrics.jsonl", None, 0, None
    while proc.poll() is None:
        logged = rows(metrics)
        if killed_at is None and any(r["step"] >= args.kill_at for r in logged):
            workers = [p for p in process_tree(proc.pid) if p != proc.pid
                       and b"titanctl" in Path(f"/proc/{p}/cmdline").read_bytes()]
            os.kill(max(workers), signal.SIGKILL)  # one rank of the two: torchrun restarts both
            killed_at, last_before = time.time(), max(r["step"] for r in logged)
        elif killed_at is not None and next_step_s is None and any(r["step"] > last_before for r in logged):
            next_step_s = time.time() - killed_at
        time.sleep(0.02)
    if proc.returncode:
        raise SystemExit(f"the whole-job run failed ({proc.returncode}); see {out.parent / 'whole_job.log'}")
    resumed = next(r["resumed_from_step"] for r in rows(metrics) if "resumed_from_step" in r)
    return {"kill_to_next_step_s": next_step_s, "retrained_steps": last_before - resumed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=12)
    p.add_argument("--checkpoint-interval", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ft = torchft_run(args, Path(tmp) / "ft")
        print(json.dumps({"torchft": ft}), flush=True)
        whole = whole_job_run(args, Path(tmp) / "whole" / "run")
    print(f"torchft (2 groups x 1): kill -> survivor's next step {ft['kill_to_next_step_s']:.2f} s; "
          f"restart -> healed group's first step {ft['restart_to_healed_s']:.2f} s "
          f"(state transfer {ft['heal_transfer_s']} s); steps lost by the survivor {ft['survivor_lost_steps']}; "
          f"the killed group sat out {ft['healed_group_missed_steps']} steps")
    print(f"whole-job restart (torchrun --max-restarts 1, FSDP 2, checkpoint every {args.checkpoint_interval}): "
          f"kill -> next new step {whole['kill_to_next_step_s']:.2f} s; steps re-trained {whole['retrained_steps']}")
    print(json.dumps({"torchft": ft, "whole_job": whole}))


if __name__ == "__main__":
    main()

"""torchft replica groups end to end: one run of scripts/ft_local.py, 2 groups x 2 processes on gloo with
tensor parallel 2 inside each group (its loss is a DTensor), group 1 SIGKILLed as a whole once it logged
step 3 and started again with the same command.

The test functions read that one run (a module fixture):
- before the kill (both groups live) the losses are one process's (test_layouts' reference, 1e-5);
- group 0 trains on alone, one row per step, its step counter never going back, no step lost;
- group 1 heals from group 0 and ends with its weights bitwise (the optimizer state came along);
- each group's data stream neither skips nor repeats a sample (logged sample ids);
- only the lowest live group writes checkpoints;
- a whole-job restart (a copy of the run, its checkpoints after a both-live step removed) repeats the
  steps after that checkpoint bit for bit in both groups.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import fork_server
from tests.conftest import REPO, torchrun_env
from tests.distributed.harness import TINY_RUN, WORKERS, losses, max_rel_diff, rows, sample_log
from tests.distributed.test_layouts import REFERENCE

STEPS, KILL_STEP, INTERVAL = 8, 3, 3
RUN = [
    *TINY_RUN, "--training.local_batch_size", "4", "--training.steps", str(STEPS),
    "--parallelism.tensor_parallel_degree", "2",
    "--checkpoint.enable_checkpoint", "--checkpoint.interval", str(INTERVAL), "--checkpoint.keep_latest_k", "0",
    # A dead peer is noticed within seconds; each wait inside the next one (config validation checks it).
    "--fault_tolerance.connect_timeout_seconds", "2", "--fault_tolerance.process_group_timeout_seconds", "5",
    "--fault_tolerance.timeout_seconds", "10", "--fault_tolerance.quorum_timeout_seconds", "30",
    "--comm.train_timeout_seconds", "60",
    # Group 0 waits while alone until the restarted group is about to join: it rejoins a step or two after
    # the kill, however loaded the machine.
    "--test-alone-wait", "120", "--test-dump-final",
    # Both groups' Managers heartbeat before either's first quorum: steps 1-3 are both groups', however
    # unevenly the two start.
    "--test-start-together", "120",
]
# A killed group restarts as slowly as a real one would: as a fork it rejoins before the others trained without it.
ENV = torchrun_env(**fork_server.OWN_PROCESSES)


def ft_local(out: Path, *launcher: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "scripts" / "ft_local.py"), "--groups", "2", "--procs-per-group", "2",
           "--dump-folder", str(out), *launcher, "--worker", str(WORKERS / "ckpt_worker.py"), "--", *RUN]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=400, cwd=REPO)
    logs = "\n".join((out / f"replica_{i}.log").read_text()[-3000:] for i in range(2) if (out / f"replica_{i}.log").exists())
    assert proc.returncode == 0, f"ft_local exit {proc.returncode}\n{proc.stdout[-2000:]}\n{logs}"
    return proc


@pytest.fixture(scope="module")
def ft_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ft")
    ft_local(out, "--kill-group", "1", "--kill-at-step", str(KILL_STEP))
    return out


def last_row_per_step(folder: Path) -> dict[int, dict]:
    return {r["step"]: r for r in rows(folder)}


def test_no_fault_steps_equal_one_process(ft_run, worlds):
    both_live = [r for r in rows(ft_run / "replica_0")[:KILL_STEP]]
    assert [(r["step"], r["live_replicas"], r["participating_ranks"]) for r in both_live] == [
        (s, 2, 4) for s in range(1, KILL_STEP + 1)]
    single = losses(worlds.folder(REFERENCE))[:KILL_STEP]
    for group in (0, 1):
        got = [r["loss"] for r in rows(ft_run / f"replica_{group}")[:KILL_STEP]]
        assert max_rel_diff(got, single) <= 1e-5, (group, got, single)


def test_survivor_trains_on_without_losing_a_step(ft_run):
    survivor = rows(ft_run / "replica_0")
    assert [r["step"] for r in survivor] == list(range(1, STEPS + 1))  # one row per step, in order
    assert all(r["lost_steps"] == 0 for r in survivor)
    alone = [r["step"] for r in survivor if r["live_replicas"] == 1]
    # It went on alone after the kill (the kill lands at step 3, or during step 4), with no restart.
    assert alone and KILL_STEP + 1 <= min(alone) <= KILL_STEP + 2, alone
    assert all(r["participating_ranks"] == 2 for r in survivor if r["live_replicas"] == 1)


def test_killed_group_heals_to_its_peers_state_bitwise(ft_run):
    group1 = rows(ft_run / "replica_1")
    healed = [r for r in group1 if "heal_seconds" in r]
    assert len(healed) == 1, group1
    heal = healed[0]
    before = [r["step"] for r in group1 if r["step"] < heal["step"]]
    # It sat out every step from the kill to the one it healed before, and none after.
    assert heal["missed_steps"] == heal["step"] - 1 - before[-1] > 0
    assert [r["step"] for r in group1] == [*range(1, before[-1] + 1), *range(heal["step"], STEPS + 1)]
    survivor = last_row_per_step(ft_run / "replica_0")
    for r in group1[len(before):]:  # back together: the same mean loss over both groups
        assert r["live_replicas"] == 2 and r["loss"] == survivor[r["step"]]["loss"]
    for rank in (0, 1):
        a = torch.load(ft_run / "replica_0" / f"final_rank{rank}.pt")
        b = torch.load(ft_run / "replica_1" / f"final_rank{rank}.pt")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_each_groups_stream_skips_and_repeats_nothing(ft_run):
    for group in (0, 1):
        # A step's row is written once the step committed. The killed group also drew the batch of the
        # step it died in (never committed: its samples come again after the heal), and a step trained
        # again after a failed commit drew its batch twice (the last draw is the one committed).
        committed = {r["step"] for r in rows(ft_run / f"replica_{group}")}
        by_rank_step = {}
        for e in sample_log(ft_run / f"replica_{group}"):
            if e["step"] in committed:
                by_rank_step[(e["dp_rank"], e["step"])] = e
        for dp_rank in (group,):  # one data-parallel rank per group (its 2 ranks are tensor parallel)
            entries = [e for (r, _), e in sorted(by_rank_step.items()) if r == dp_rank]
            # Its position advances by one global batch per step it trained, whichever steps those were.
            assert [e["consumed_before"] for e in entries] == [8 * i for i in range(len(entries))], (group, dp_rank)
            ids = [row for e in entries for row in e["rows"]]
            assert len(ids) == len(set(ids))
    group1_steps = sorted({e["step"] for e in sample_log(ft_run / "replica_1")})
    assert len(group1_steps) < STEPS  # it did miss steps, and resumed its own stream after them


def test_only_the_lowest_live_group_writes_checkpoints(ft_run):
    assert sorted(p.name for p in (ft_run / "replica_0" / "checkpoint").iterdir()) == [
        f"step-{s}" for s in (3, 6, 8)]
    folder = ft_run / "replica_1" / "checkpoint"
    assert not folder.exists() or not any(folder.iterdir())


def test_whole_job_restart_from_the_checkpoints_is_bitwise(ft_run, tmp_path):
    """The whole job again (both groups, the same command without the kill) from the newest checkpoint
    after which both groups trained every step: group 0 loads it, group 1 heals from group 0 and takes its
    own stream's position at that step; the steps after it repeat the kill run's losses bit for bit."""
    before = [last_row_per_step(ft_run / f"replica_{g}") for g in range(2)]
    both_live = [s for s in range(INTERVAL, STEPS, INTERVAL)
                 if all(s in before[1] and before[g][t]["live_replicas"] == 2 for g in range(2) for t in range(s + 1, STEPS + 1))]
    assert both_live, before[1]  # group 1 was back before the last checkpoint but one
    resume = both_live[-1]
    copy = tmp_path / "again"
    shutil.copytree(ft_run, copy)
    for later in (copy / "replica_0" / "checkpoint").iterdir():
        if int(later.name.removeprefix("step-")) > resume:
            shutil.rmtree(later)
    ft_local(copy, "--min-replicas", "2")  # both groups in every quorum, from the first
    for g in range(2):
        after = last_row_per_step(copy / f"replica_{g}")
        replayed = range(resume + 1, STEPS + 1)
        assert [after[s]["loss"] for s in replayed] == [before[g][s]["loss"] for s in replayed], g
    healed = [r["step"] for r in rows(copy / "replica_1") if "heal_seconds" in r]
    assert healed[-1] == resume + 1 and len(healed) == 2, healed  # the kill run's heal, then this one

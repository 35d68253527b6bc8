"""Hostile and damaged checkpoints resumed under torchrun (2 ranks, gloo): a pickle payload in
``.metadata`` or in a non-tensor item never runs and every rank stops with the refusal; a 4 KB bit
flip is found by the checksums (hashed in shares by the ranks, agreed over the checkpoint group) and
the run falls back to the previous step, continuing exactly as the uninterrupted run did.

The checkpoints come from the session's one-process run (``trained_run``): resuming it with FSDP
over 2 ranks is a layout change, which titanctl supports."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, TRUSTED_RUN, torchrun_env
from tests.unit.checkpoint.test_checkpoint_trust import FLIP_MESSAGE, PAYLOADS, STEP, clone, flip_4k, tree_hash

FSDP2 = ["--training.local_batch_size", "4"]


def torchrun_train(args: list) -> subprocess.CompletedProcess:
    env = torchrun_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "titanctl", "train", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400, cwd=REPO)


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_payload_never_runs_under_torchrun(trained_run, tmp_path, kind):
    run_dir = clone(trained_run, tmp_path / "run")
    poison, message = PAYLOADS[kind]
    poison(run_dir / STEP, tmp_path / "marker")
    before = tree_hash(run_dir / "checkpoint")
    proc = torchrun_train([*TRUSTED_RUN, *FSDP2, "--training.steps", "3", "--job.dump_folder", run_dir])
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "exitcode  : 2" in proc.stderr, proc.stderr[-4000:]  # torchrun's report of the failed ranks
    refusals = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert refusals and all(re.search(message, line) for line in refusals), proc.stderr[-4000:]
    assert f'File "{REPO / "titanctl"}' not in proc.stderr, "a traceback through titanctl (torchrun prints its own)"
    assert not (tmp_path / "marker").exists(), "the payload ran"
    assert tree_hash(run_dir / "checkpoint") == before, "a refused checkpoint changed on disk"


def test_bit_flip_falls_back_to_the_previous_step_under_torchrun(trained_run, tmp_path):
    run_dir = clone(trained_run, tmp_path / "run")
    flip_4k(run_dir / STEP)
    proc = torchrun_train([*TRUSTED_RUN, *FSDP2, "--job.dump_folder", run_dir])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    notes = [line for line in proc.stdout.splitlines() if "note:" in line]
    assert len(notes) == 1 and re.search(FLIP_MESSAGE, notes[0]), proc.stdout[-3000:]
    assert notes[0].rstrip().endswith(f"falling back to {run_dir / 'checkpoint' / 'step-1'}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2
    assert abs(rows[-1]["loss"] - reference[-1]["loss"]) <= 1e-5 * abs(reference[-1]["loss"]), (rows, reference)

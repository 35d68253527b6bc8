"""Checkpoints of a Mixture-of-Experts run under expert parallelism (EP 2, real torchrun + gloo):
resuming in the same layout reproduces the run bit for bit, and a checkpoint written by EP 2
resumes in one process (EP 1), where each expert is whole again, with the losses of the EP 2 run.

Both balancing methods are on, so the router's score-correction bias (a buffer the checkpoint
carries) and the auxiliary loss take part in what must come back.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.distributed.harness import WORKERS, losses_by_step, samples_by_step, torchrun
from tests.distributed.test_checkpoint import RUN as CHECKPOINT_RUN
from tests.distributed.test_checkpoint import flatten, read_dcp

WORKER = [str(WORKERS / "ckpt_worker.py")]
# The checkpoint tests' run (6 steps, saves at 2, 4 and 6) with a 2-layer Qwen3-MoE, every save kept.
RUN = [
    *CHECKPOINT_RUN, "--model.n_layers", "2", "--checkpoint.keep_latest_k", "0",
    "--model.name", "qwen3_moe", "--model.flavor", "debugmodel",
    "--moe.load_balance_coeff", "0.01", "--moe.router_aux_loss_coef", "0.01",
]
EP2 = ["--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"]


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    """EP 2 for 6 steps (saves at 2, 4, 6), then, in the same process group, resumed from step-2."""
    out = tmp_path_factory.mktemp("ep2_run")
    torchrun(2, WORKER, ["--test-resume-from", "2", *RUN, *EP2, "--job.dump_folder", str(out)])
    return out


def test_ep2_resume_is_bitwise(ep_run):
    first, again = losses_by_step(ep_run), losses_by_step(ep_run / "resumed")
    assert sorted(again) == [3, 4, 5, 6]
    assert [again[s] for s in range(3, 7)] == [first[s] for s in range(3, 7)], (first, again)
    final = flatten(read_dcp(ep_run / "checkpoint" / "step-6"))
    resumed_final = flatten(read_dcp(ep_run / "resumed" / "checkpoint" / "step-6"))
    assert resumed_final.keys() == final.keys()
    assert all(torch.equal(resumed_final[k], v) if isinstance(v, torch.Tensor) else resumed_final[k] == v
               for k, v in final.items())
    assert any(".experts.w1" in k for k in final) and any("expert_bias" in k for k in final)


def test_ep2_checkpoint_resumes_in_one_process(ep_run, tmp_path):
    (tmp_path / "checkpoint").mkdir()
    shutil.copytree(ep_run / "checkpoint" / "step-4", tmp_path / "checkpoint" / "step-4")
    torchrun(1, WORKER, [*RUN, "--training.local_batch_size", "8", "--job.dump_folder", str(tmp_path)])
    ref, got = losses_by_step(ep_run), losses_by_step(tmp_path)
    assert sorted(got) == [5, 6]
    for step in (5, 6):  # step 6 depends on the optimizer state of the experts that came across
        assert abs(got[step] - ref[step]) <= 1e-5 * abs(ref[step]), (step, got[step], ref[step])
    assert samples_by_step(tmp_path) == {s: v for s, v in samples_by_step(ep_run).items() if s > 4}
    ref_final = flatten(read_dcp(ep_run / "checkpoint" / "step-6"))
    got_final = flatten(read_dcp(tmp_path / "checkpoint" / "step-6"))
    weights = [k for k in ref_final if k.startswith(("model.", "optimizer.state."))]
    assert any(".experts.w1" in k for k in weights)
    for key in weights:
        value = ref_final[key]
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got_final[key], value, rtol=1e-4, atol=1e-6, msg=key)

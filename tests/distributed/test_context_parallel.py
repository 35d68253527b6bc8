"""Context parallel (ring attention on CPU/gloo) reproduces one-process losses.

The distributed tests share one launch of ``workers/cp_worker.py`` under torchrun with 2
processes, which trains the reference and one CP run per rotate method (allgather, alltoall);
the rest checks the argument validation and registration without a process group.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, torchrun_env
from titanctl.errors import ParallelError
from titanctl.parallel.layouts.context_parallel import (
    check_cp_divisibility,
    context_parallel_ctx,
    enable_cpu_ring_attention,
)

WORKER = Path(__file__).parent / "workers" / "cp_worker.py"
REL_TOL = 1e-5


ROTATE_METHODS = ("allgather", "alltoall")


@pytest.fixture(scope="module")
def cp_result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One torchrun launch (2 processes) trains the reference and a CP run per rotate method."""
    out = tmp_path_factory.mktemp("cp") / "losses.json"
    env = torchrun_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(WORKER), ",".join(ROTATE_METHODS), str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"torchrun exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return json.loads(out.read_text())


@pytest.mark.parametrize("rotate_method", ROTATE_METHODS)
def test_cp_losses_match_single_process(rotate_method: str, cp_result: dict) -> None:
    run = cp_result["runs"][rotate_method]
    expected_option = {"allgather": "ALL_GATHER", "alltoall": "ALL_TO_ALL"}[rotate_method]
    assert run["torch_rotate_option"] == expected_option

    ref, cp = cp_result["ref"], run["cp"]
    assert len(ref) == len(cp) >= 3
    rel = [abs(a - b) / abs(a) for a, b in zip(ref, cp)]
    assert max(rel) <= REL_TOL, (
        f"{rotate_method}: max relative loss difference {max(rel):.3e} > {REL_TOL:g}\n"
        f"ref {ref}\ncp  {cp}"
    )
    # Each rank saw different tokens (so its loss differs from the global one), and the
    # training really moved: the check above is not comparing constants.
    assert all(len(set(per_rank)) == 2 for per_rank in run["cp_rank_losses"])
    assert ref[-1] < ref[0]
    dw = run["max_weight_diff"]
    assert dw < 1e-4, dw
    print(f"{rotate_method}: max rel loss diff {max(rel):.2e}, max |dW| {dw:.2e}")


@pytest.mark.parametrize(("seq_len", "cp"), [(32, 1), (7, 1), (32, 2), (64, 4), (48, 3)])
def test_cp_divisibility_ok(seq_len: int, cp: int) -> None:
    check_cp_divisibility(seq_len, cp)


@pytest.mark.parametrize(("seq_len", "cp"), [(30, 2), (32, 3), (36, 4), (33, 2)])
def test_cp_divisibility_rejects(seq_len: int, cp: int) -> None:
    message = rf"divisible by 2 x cp = {2 * cp}\b.*seq_len is {seq_len}\b"
    with pytest.raises(ParallelError, match=message):
        check_cp_divisibility(seq_len, cp)


def test_cp_degree_must_be_positive() -> None:
    with pytest.raises(ParallelError, match="degree must be >= 1, got 0"):
        check_cp_divisibility(32, 0)


def test_enable_cpu_ring_attention_is_idempotent_and_scoped() -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention

    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    enable_cpu_ring_attention()
    handlers = (_attention.custom_ops[fwd], _attention.custom_ops[bwd])
    enable_cpu_ring_attention()
    assert (_attention.custom_ops[fwd], _attention.custom_ops[bwd]) == handlers
    # Registered in CP's own table: DTensor sees it only while context_parallel is active.
    assert fwd not in DTensor._op_dispatcher._custom_op_handlers


class _FakeMesh:
    """Enough of a 1-D DeviceMesh for the checks that run before any communication."""

    ndim, device_type = 1, "cpu"

    def size(self) -> int:
        return 2


def test_cp_ctx_rejects_a_longer_rope_table() -> None:
    inputs = torch.zeros(2, 32, dtype=torch.long)
    rope = torch.zeros(64, 8, 2)
    message = "length 64 along dim 0.*seq_len 32.*max_seq_len == seq_len"
    with pytest.raises(ParallelError, match=message):
        with context_parallel_ctx(_FakeMesh(), buffers=[inputs, rope], seq_dims=[1, 0],
                                  no_restore={inputs}, rotate_method="allgather"):  # fmt: skip
            pass


def test_cp_ctx_rejects_bad_rotate_method_and_seq_len() -> None:
    inputs = torch.zeros(2, 32, dtype=torch.long)
    with pytest.raises(ParallelError, match="rotate method 'ring'"):
        with context_parallel_ctx(_FakeMesh(), buffers=[inputs], seq_dims=[1], no_restore=set(),
                                  rotate_method="ring"):  # fmt: skip
            pass
    odd = torch.zeros(2, 30, dtype=torch.long)
    with pytest.raises(ParallelError, match="seq_len is 30"):
        with context_parallel_ctx(_FakeMesh(), buffers=[odd], seq_dims=[1], no_restore=set(),
                                  rotate_method="allgather"):  # fmt: skip
            pass

"""Hugging Face saves from sharded training on real torchrun + gloo: the folder a layout writes is,
file by file and tensor by tensor, bitwise what `titanctl convert --to hf` makes of that layout's own
DCP checkpoint of the same step.

Two runs cover the ways tensors leave a sharded model: pipeline stages on different ranks (stage 1's
tensors are sent to rank 0), with Qwen3-MoE's experts (one tensor per expert); and FSDP x TP (2-D `_StridedShard`
DTensors gathered on 4 ranks) with Qwen3's tied embedding, which Hugging Face stores once. DDP, HSDP,
CP, interleaved PP, PP x TP with a bf16 export and FSDP with float8 all-gathers were checked the same
way by hand (see docs/checkpoints.md); one process is tests/unit/checkpoint/test_hf_save.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.distributed.harness import CLI, torchrun
from titanctl.checkpoint.convert import convert_checkpoint
from titanctl.checkpoint.formats.hf import HFSource

RUN = [
    "--model.n_layers", "2",
    "--training.seq_len", "32",
    "--training.global_batch_size", "4",
    "--training.steps", "2",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "1",
    "--metrics.log_freq", "1",
    "--activation_checkpoint.mode", "none",
    "--checkpoint.enable_checkpoint",
    "--checkpoint.interval", "1",
    "--checkpoint.keep_latest_k", "1",
]
CASES = {
    # Qwen3-MoE, 2 pipeline stages: stage 1's experts travel to rank 0; only the last step in HF.
    "moe_pp2": (2, [
        "--model.name", "qwen3_moe", "--model.flavor", "debugmodel", "--training.local_batch_size", "4",
        "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1",
        "--checkpoint.last_save_in_hf",
    ]),
    # Qwen3 (tied), FSDP 2 x TP 2, every save in both formats, the newest one kept.
    "qwen3_tied_fsdp2_tp2": (4, [
        "--model.name", "qwen3", "--model.flavor", "debugmodel", "--training.local_batch_size", "2",
        "--parallelism.tensor_parallel_degree", "2", "--checkpoint.save_format", "both",
    ]),
}


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder under its own name, found as convert finds them (the index, or the
    one model.safetensors that a single-shard save writes without one)."""
    out = {}
    for key, path, _shape, _dtype in HFSource(folder).raw:
        with safe_open(str(path), framework="pt") as f:
            out[key] = f.get_tensor(key)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_hf_save_of_a_sharded_run_equals_convert_of_its_dcp_step(tmp_path, case):
    start = time.perf_counter()
    nproc, overrides = CASES[case]
    torchrun(nproc, [*CLI, "train"], [*RUN, *overrides, "--job.dump_folder", str(tmp_path / "run")])
    seconds = time.perf_counter() - start
    root = tmp_path / "run" / "checkpoint"
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-2-hf"]  # step-1 went: keep 1
    convert_checkpoint(root / "step-2", tmp_path / "converted", dst_format="hf")
    ours, theirs = tensors(root / "step-2-hf"), tensors(tmp_path / "converted")
    assert ours.keys() == theirs.keys()
    for key, tensor in theirs.items():
        assert ours[key].dtype == tensor.dtype and torch.equal(ours[key], tensor), key
    for name in sorted(p.name for p in (tmp_path / "converted").iterdir()):
        assert (root / "step-2-hf" / name).read_bytes() == (tmp_path / "converted" / name).read_bytes(), name
    if "tied" in case:
        assert "lm_head.weight" not in ours
    else:
        assert "model.layers.1.mlp.experts.7.gate_proj.weight" in ours  # one tensor per expert, from stage 1
    print(f"\nHF SAVE {case:24s} procs {nproc}  {seconds:5.1f} s")

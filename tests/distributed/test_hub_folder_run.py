"""A run sharded over 2 ranks (FSDP 2) from the Hub's Qwen3.5 folder carries its vision encoder and MTP head:
rank 0 alone holds them, writes them into the DCP step (the other rank's plan holds none) and into the Hugging
Face save, which the ranks gather in the same write order. The single-process run and the folder's conversions:
tests/unit/checkpoint/test_qwen3_5_hub_layout.py. The case shares the torchrun world of 2 processes."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.distributed.harness import TINY_RUN
from tests.distributed.worlds import ROOT, register

RUN = [*TINY_RUN, "--model.name", "qwen3_5", "--model.flavor", "debugmodel", "--model.n_layers", "2",
       "--training.steps", "1", "--training.local_batch_size", "4", "--checkpoint.enable_checkpoint",
       "--checkpoint.last_save_in_hf", "--checkpoint.initial_load_path", f"{ROOT}/qwen3_5_hub",
       "--checkpoint.initial_load_model_weights_only"]


def args_of(root: Path):
    from titanctl.config.recipe import load_config
    from titanctl.models.registry import model_args_from_config

    cfg = load_config(None, [arg.replace(ROOT, str(root)) for arg in RUN])
    return model_args_from_config(cfg.model, 4352, cfg.training.seq_len)


def write_hub_folder(root: Path) -> None:
    from tests.unit.checkpoint.test_qwen3_5_hub_layout import hub_folder_of

    if not (root / "qwen3_5_hub").exists():
        hub_folder_of(args_of(root), root / "qwen3_5_hub")


CASE = register(__name__, "fsdp2", 2, RUN, prepare=write_hub_folder)


def test_a_sharded_run_carries_the_folders_other_parts(worlds, tmp_path):
    from tests.unit.checkpoint.test_qwen3_5_hub_layout import assert_carries
    from tests.unit.checkpoint.test_qwen3_checkpoints import safetensors_of
    from titanctl.checkpoint.convert import convert_checkpoint

    root = worlds.folder(CASE) / "checkpoint"
    state = safetensors_of(worlds.root / "qwen3_5_hub")
    saved = assert_carries(root / "step-1-hf", state)
    convert_checkpoint(root / "step-1", tmp_path / "exported", dst_format="hf")  # the DCP step holds them too
    exported = safetensors_of(tmp_path / "exported")
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], v) for k, v in saved.items())

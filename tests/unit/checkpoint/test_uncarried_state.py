"""Trained state a format has no slot for (titanctl.checkpoint.hf.uncarried): the MoE expert bias that
moe.load_balance_coeff trains, which Hugging Face's gpt-oss and Qwen3-MoE formats do not store, is refused
in one line by `--to hf` unless --drop-expert-bias accepts the loss; dcp and torchtitan carry it exactly; a
zero bias (the balancing off) exports as before; a run that would save it into HF folders does not start."""

from __future__ import annotations

import pytest
import torch

from tests.unit.hf_reference import unit_scale_
from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint, save_state_dict
from titanctl.checkpoint.hf.uncarried import check_hf_saves
from titanctl.errors import CheckpointError, ConfigError
from titanctl.models.common.decoder import Transformer
from titanctl.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS
from titanctl.models.gpt_oss.args import GPT_OSS_FLAVORS
from titanctl.models.qwen3_moe.args import QWEN3_MOE_FLAVORS
from titanctl.models.registry import build_model

GPT_OSS = GPT_OSS_FLAVORS["debugmodel"].replace(n_layers=2, vocab_size=300, max_seq_len=64)
QWEN3_MOE = QWEN3_MOE_FLAVORS["debugmodel"].replace(n_layers=2, vocab_size=300, max_seq_len=64)
IDS = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))


def model_with_bias(args, bias: bool) -> Transformer:
    torch.manual_seed(0)
    model = build_model(args).eval()
    unit_scale_(model, torch.Generator().manual_seed(1))  # logits far from flat: a routing change shows
    if bias:  # as load balancing leaves it: some experts favoured, some not
        with torch.no_grad():
            model.layers["1"].moe.expert_bias.copy_(torch.linspace(-0.5, 0.5, args.moe.num_experts))
    return model


@pytest.mark.parametrize("args", [GPT_OSS, QWEN3_MOE], ids=["gpt_oss", "qwen3_moe"])
def test_a_trained_expert_bias_is_refused_by_hf_and_carried_by_dcp_and_torchtitan(args, tmp_path):
    model = model_with_bias(args, bias=True)
    save_state_dict(model.state_dict(), args, tmp_path / "dcp")
    with pytest.raises(CheckpointError) as error:
        convert_checkpoint(tmp_path / "dcp", tmp_path / "hf", dst_format="hf")
    message = str(error.value)
    assert "\n" not in message and message.startswith("layers.1.moe.expert_bias holds trained values")
    assert "--drop-expert-bias" in message and not (tmp_path / "hf").exists()
    for fmt in ("torchtitan", "dcp"):
        convert_checkpoint(tmp_path / "dcp", tmp_path / f"to_{fmt}", dst_format=fmt)
        back, _ = load_checkpoint(tmp_path / f"to_{fmt}")
        assert torch.equal(back["layers.1.moe.expert_bias"], model.layers["1"].moe.expert_bias), fmt


def test_drop_expert_bias_exports_the_model_with_a_zero_bias_and_says_so(tmp_path):
    model = model_with_bias(GPT_OSS, bias=True)
    save_state_dict(model.state_dict(), GPT_OSS, tmp_path / "dcp")
    report = convert_checkpoint(tmp_path / "dcp", tmp_path / "hf", dst_format="hf", drop_expert_bias=True)
    assert any(note.startswith("--drop-expert-bias: the trained expert bias of 1 layers was left out")
               for note in report.notes), report.notes
    import transformers

    theirs = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        biased = model(IDS)
        model.layers["1"].moe.expert_bias.zero_()
        unbiased, exported = model(IDS), theirs(IDS).logits
    assert (exported - unbiased).abs().max() <= 1e-4  # what the note says changes, and nothing else
    assert (exported - biased).abs().max() > 1e-2


def test_a_zero_bias_exports_exactly(tmp_path):
    model = model_with_bias(GPT_OSS, bias=False)
    save_state_dict(model.state_dict(), GPT_OSS, tmp_path / "dcp")
    report = convert_checkpoint(tmp_path / "dcp", tmp_path / "hf", dst_format="hf")
    assert not any("expert bias" in note for note in report.notes)
    import transformers

    theirs = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (theirs(IDS).logits - model(IDS)).abs().max() <= 1e-4


def test_hf_saves_of_a_bias_trained_run_are_refused_before_it_starts():
    with pytest.raises(ConfigError, match=r"^moe.load_balance_coeff = 0.001 trains an expert bias that the Hugging "
                                          r"Face gpt_oss folders this run saves"):
        check_hf_saves(0.001, GPT_OSS)
    check_hf_saves(0.0, GPT_OSS)
    check_hf_saves(0.001, DEEPSEEK_V3_FLAVORS["debugmodel"])  # its HF format stores it (e_score_correction_bias)


def test_peft_exports_of_a_lora_step_carry_only_the_bias_of_the_base():
    """peft puts a LoRA step's adapters on the base's Hugging Face model: no bias for Qwen3-MoE (a moved one is
    refused), the base's for DeepSeek-V3 (read only when the step's is not zero, refused when it is another)."""
    from titanctl.checkpoint.hf.uncarried import check_adapter_export

    deepseek = DEEPSEEK_V3_FLAVORS["debugmodel"].replace(n_layers=2, vocab_size=300)
    name = "layers.1.moe.expert_bias"
    moved = {name: torch.linspace(-0.5, 0.5, 8)}
    never = lambda names: pytest.fail("the base was read")  # noqa: E731
    assert check_adapter_export({name: torch.zeros(8)}, QWEN3_MOE, False, never) is None
    assert check_adapter_export({name: torch.zeros(8)}, deepseek, False, never) is None
    assert check_adapter_export(moved, deepseek, False, lambda names: {n: moved[n].clone() for n in names}) is None
    for args, base in ((QWEN3_MOE, never), (deepseek, lambda names: {n: torch.zeros(8) for n in names})):
        with pytest.raises(CheckpointError, match=rf"^{name} holds trained values \(moe.load_balance_coeff\) that "
                                                  rf"peft cannot carry \(it adapts the base's Hugging Face {args.family}"):
            check_adapter_export(moved, args, False, base)
        assert check_adapter_export(moved, args, True, base).startswith("--drop-expert-bias: the trained expert bias")

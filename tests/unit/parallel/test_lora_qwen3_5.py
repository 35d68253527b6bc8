"""LoRA on the hybrid families (Qwen3.5 dense and MoE, Qwen3-Next) as on Qwen3: the adapted forward equals peft's
LoRA on transformers' ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` / ``Qwen3NextForCausalLM`` with the same
adapters, exported by titanctl's peft writer; the targets reach the Gated DeltaNet's projections (``wqkv``, ``wz``,
``wb``, ``wa``, ``out_proj``; Qwen3-Next's fused ``wqkvz``, ``wba``), the gated full attention's and the routed
experts."""

from __future__ import annotations

import pytest
import torch

from tests.unit.hf_reference import args_of, titanctl_model_of, unit_scale_
from tests.unit.models.families import qwen3_5_config, qwen3_5_moe_config, qwen3_next_config
from tests.unit.parallel.test_lora import TOL, peft_model, random_adapters
from titanctl.config.job_config import LoRA as LoRAConfig
from titanctl.parallel.converters.lora import apply_lora

CASES = {
    "qwen3_5_attention_ffn": ("Qwen3_5ForCausalLM", qwen3_5_config,
                              LoRAConfig(rank=4, alpha=8.0, target_modules=["attention", "feed_forward"])),
    "qwen3_5_moe_experts": ("Qwen3_5MoeForCausalLM", qwen3_5_moe_config,
                            LoRAConfig(rank=8, alpha=6.0, target_modules=[  # wb, wa: 4 heads wide, below rank 8
                                "attention.wqkv", "attention.wz", "attention.out_proj", "attention.wq",
                                "attention.wo", "moe.experts"])),
    "qwen3_next_fused": ("Qwen3NextForCausalLM", qwen3_next_config,  # wba: 8 rows (b and a of 4 heads), rank 8
                         LoRAConfig(rank=8, alpha=8.0, target_modules=["attention", "moe.experts"])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_equals_peft(case):
    import transformers

    cls, config, cfg = CASES[case]
    torch.manual_seed(0)
    theirs = getattr(transformers, cls)(config()).eval()
    unit_scale_(theirs, torch.Generator().manual_seed(0))
    args = args_of(theirs)
    ours = titanctl_model_of(theirs)
    record = apply_lora(ours, cfg).record()
    adapters = random_adapters(ours)
    ours.eval()
    fused = case == "qwen3_next_fused"
    gated_deltanet = (".attention.wqkvz.", ".attention.wba.") if fused else (".attention.wqkv.",)
    assert all(any(p in name for name in adapters) for p in gated_deltanet)
    assert any(".attention.wq." in name for name in adapters)
    assert any(".experts." in name for name in adapters) == (case != "qwen3_5_attention_ffn")
    ids = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = theirs(ids).logits
        peft = peft_model(transformers, theirs, args, adapters, record)(ids).logits
        got = ours(ids)
    scale = peft.abs().max().item()
    delta, moved = (got - peft).abs().max().item(), (peft - base).abs().max().item()
    print(f"\nLORA {case}: max |Δlogit| vs peft {delta:.2e} of logits up to {scale:.1f}; adapters move {moved:.2f}")
    assert moved > 0.1 * scale, "the adapters hardly changed anything: the comparison has no teeth"
    # fp32 (grouped matmuls take no fp64): MoE measured 1.3e-5 of the largest logit, as its parity test's 4.5e-5
    # without adapters; dense 4e-7.
    tol = TOL if case == "qwen3_5_attention_ffn" else 3 * TOL
    assert delta <= tol * scale, f"{case}: ours differs from peft's LoRA by {delta:.3g}"

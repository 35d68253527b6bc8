"""A LoRA step out of titanctl: ``convert --to hf --merge-lora`` writes a folder transformers loads with
the logits of base plus adapters, and ``convert --to peft`` one that ``PeftModel.from_pretrained`` loads
onto the base transformers model with the same logits; both equal titanctl's own forward of base plus
adapters. What cannot be converted is refused in one line.

The LoRA run trains on the session's trained model exported to Hugging Face (tests/conftest.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.unit.checkpoint.test_lora_checkpoints import LORA_RUN
from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint, open_checkpoint
from titanctl.checkpoint.lora.export import PEFT_CONFIG, PEFT_WEIGHTS, read_adapters
from titanctl.config.job_config import LoRA as LoRAConfig
from titanctl.config.recipe import load_config
from titanctl.errors import CheckpointError
from titanctl.models.common.decoder import Transformer
from titanctl.parallel.converters.lora import apply_lora
from titanctl.train.trainer import Trainer

TOL = 1e-5  # of the largest logit (fp32)


@pytest.fixture(scope="module")
def lora_step(foreign_formats, tmp_path_factory) -> dict:
    """A LoRA run of 3 steps on a copy of the Hugging Face base (a high lr, so the adapters matter)."""
    root = tmp_path_factory.mktemp("lora_export")
    base = root / "base"
    shutil.copytree(foreign_formats["hf"], base)
    cfg = load_config(None, [*LORA_RUN, "--checkpoint.initial_load_path", str(base), "--training.steps", "3",
                             "--checkpoint.interval", "3", "--optimizer.lr", "3e-2", "--lora.target_modules",
                             "attention,feed_forward.w2", "--job.dump_folder", str(root / "run")])
    Trainer(cfg).train()
    return {"root": root, "base": base, "step": root / "run" / "checkpoint" / "step-3"}


def ours(step: Path, base: Path) -> torch.nn.Module:
    """titanctl's model of the base with the step's adapters."""
    meta, record, adapters = read_adapters(step)
    state, args = load_checkpoint(base)
    model = Transformer(args)
    model.load_state_dict(state, strict=False)
    apply_lora(model, LoRAConfig(rank=record["rank"], alpha=record["alpha"], target_modules=list(record["targets"])))
    model.load_state_dict(adapters, strict=False)
    return model.eval()


@pytest.mark.slow
def test_merged_and_peft_exports_give_the_logits_of_base_plus_adapters(lora_step, tmp_path):
    import transformers
    from peft import PeftModel

    merged, adapter = tmp_path / "merged", tmp_path / "peft"
    report = convert_checkpoint(lora_step["step"], merged, dst_format="hf", merge_lora=True)
    assert report.dst_format == "hf" and any("merged" in note for note in report.notes)
    convert_checkpoint(lora_step["step"], adapter, dst_format="peft")
    assert {p.name for p in adapter.iterdir()} == {PEFT_CONFIG, PEFT_WEIGHTS}
    shards = sorted(p.name for p in lora_step["base"].glob("model*"))
    assert sorted(p.name for p in merged.glob("model*")) == shards and len(shards) > 2  # the base's own files
    config = json.loads((adapter / PEFT_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 16.0, str(lora_step["base"]))
    keys = set(load_file(adapter / PEFT_WEIGHTS))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys and len(keys) == 2 * 2 * 5

    ids = torch.randint(0, 4352, (2, 48), generator=torch.Generator().manual_seed(0))
    load = dict(dtype=torch.float32)
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(lora_step["base"], **load).eval()
        base_logits = base(ids).logits
        peft = PeftModel.from_pretrained(base, adapter).eval()(ids).logits
        merged_logits = transformers.AutoModelForCausalLM.from_pretrained(merged, **load).eval()(ids).logits
        titanctl = ours(lora_step["step"], lora_step["base"])(ids)
    scale = peft.abs().max().item()
    moved = (peft - base_logits).abs().max().item()
    deltas = {"merged vs peft": (merged_logits - peft).abs().max().item(),
              "titanctl vs peft": (titanctl - peft).abs().max().item()}
    print(f"\nLORA export: logits up to {scale:.1f}, the adapters move them by up to {moved:.3f}; {deltas}")
    assert moved > 1000 * TOL * scale, "the adapters hardly changed the logits: the comparison has no teeth"
    for what, delta in deltas.items():
        assert delta <= TOL * scale, f"{what}: {delta:.3g}"


@pytest.mark.slow
def test_merge_into_any_format_and_from_a_moved_base(lora_step, tmp_path):
    moved = tmp_path / "moved_base"
    shutil.copytree(lora_step["base"], moved)
    _, record, adapters = read_adapters(lora_step["step"])
    convert_checkpoint(lora_step["step"], tmp_path / "dcp", dst_format="dcp", merge_lora=True, lora_base=moved)
    merged, _ = load_checkpoint(tmp_path / "dcp")
    base, _ = load_checkpoint(lora_step["base"])
    scale = record["alpha"] / record["rank"]
    for target in record["targets"]:
        a, b = adapters[f"{target}.lora_a"], adapters[f"{target}.lora_b"]
        assert torch.allclose(merged[f"{target}.weight"], base[f"{target}.weight"] + scale * b @ a, atol=1e-6)
    untouched = "layers.0.feed_forward.w1.weight"
    assert torch.equal(merged[untouched], base[untouched])


def test_what_convert_refuses(lora_step, trained_run, tmp_path):
    step = lora_step["step"]
    with pytest.raises(CheckpointError, match="holds LoRA adapters only .*add --merge-lora .* or use --to peft"):
        convert_checkpoint(step, tmp_path / "out", dst_format="hf")
    with pytest.raises(CheckpointError, match="--merge-lora reads a LoRA run's step folder; .* holds no LoRA"):
        convert_checkpoint(trained_run / "checkpoint" / "step-2", tmp_path / "out", dst_format="hf", merge_lora=True)
    with pytest.raises(CheckpointError, match="--to peft writes the adapters alone"):
        convert_checkpoint(step, tmp_path / "out", dst_format="peft", merge_lora=True)
    with pytest.raises(CheckpointError, match="holds LoRA adapters only .*not a whole model: merge them"):
        open_checkpoint(step)  # what generation and every reader of whole models open
    with pytest.raises(CheckpointError, match="no peft adapter folder: adapter_config.json is missing"):
        convert_checkpoint(step, tmp_path / "out", src_format="peft", lora_base=lora_step["base"])
    other = tmp_path / "other_base"
    shutil.copytree(trained_run / "checkpoint" / "step-1", other)
    with pytest.raises(CheckpointError, match="is not the one the adapters of .* were trained on"):
        convert_checkpoint(step, tmp_path / "out", merge_lora=True, lora_base=other)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def moe_lora_step(tmp_path_factory) -> dict:
    """One LoRA step of a random Qwen3-MoE with adapters on its experts, whose expert bias load balancing moved."""
    from titanctl.checkpoint.convert import save_state_dict
    from titanctl.models.qwen3_moe.args import QWEN3_MOE_FLAVORS
    from titanctl.parallel.layouts.weight_init import initialize_weights

    root = tmp_path_factory.mktemp("moe_lora")
    args = QWEN3_MOE_FLAVORS["debugmodel"].replace(n_layers=2, vocab_size=4352, max_seq_len=64)
    model = Transformer(args)
    initialize_weights(model, seed=0)  # the expert stacks are made empty: uninitialized memory otherwise
    save_state_dict(model.state_dict(), args, root / "base")
    cfg = load_config(None, [*LORA_RUN, "--model.name", "qwen3_moe", "--checkpoint.initial_load_path",
                             str(root / "base"), "--training.steps", "1", "--checkpoint.interval", "1",
                             "--lora.target_modules", "attention,moe.experts", "--lora.rank", "8",
                             "--moe.load_balance_coeff", "0.01", "--job.dump_folder", str(root / "run")])
    Trainer(cfg).train()
    return {"base": root / "base", "step": root / "run" / "checkpoint" / "step-1"}


@pytest.mark.slow
def test_peft_export_of_expert_adapters_says_which_transformers_load_them(moe_lora_step, tmp_path):
    """peft's target_parameters attach to transformers 5's packed experts; on 4.57 they match nothing (peft only
    warns): the export says so in one note."""
    from titanctl.checkpoint.lora.export import EXPERT_ADAPTERS_NOTE

    report = convert_checkpoint(moe_lora_step["step"], tmp_path / "peft", dst_format="peft", drop_expert_bias=True)
    assert EXPERT_ADAPTERS_NOTE in report.notes and "transformers 5.x" in EXPERT_ADAPTERS_NOTE
    assert json.loads((tmp_path / "peft" / PEFT_CONFIG).read_text())["target_parameters"]


# ----------------------------------------------------------------------------- edited records (issue 57, class 6)


def edited_copy(step: Path, root: Path, change, *, rerecord: bool) -> Path:
    """A copy of the LoRA step whose titanctl.json is changed; ``rerecord``: as a careful attacker, with the
    checksum of its fields recomputed."""
    from titanctl.checkpoint.trust.metadata import fields_digest

    copy = root / "step-3"
    shutil.copytree(step, copy)
    meta = json.loads((copy / "titanctl.json").read_text())
    change(meta)
    if rerecord:
        meta["checksums"]["fields"] = fields_digest(meta)
    (copy / "titanctl.json").write_text(json.dumps(meta))
    return copy


@pytest.mark.parametrize("to", ["merge", "peft"])
def test_an_edited_lora_record_is_refused(lora_step, tmp_path, to):
    """A titanctl.json edited to rank 10^9 (the adapters have rank 4) merged and exported with exit 0."""
    def rank(meta):
        meta["lora"]["rank"] = 10**9

    kwargs = dict(dst_format="hf", merge_lora=True) if to == "merge" else dict(dst_format="peft")
    plain = edited_copy(lora_step["step"], tmp_path / "plain", rank, rerecord=False)
    with pytest.raises(CheckpointError, match="titanctl.json: its fields do not match the sha256 checksum"):
        convert_checkpoint(plain, tmp_path / "out", **kwargs)
    careful = edited_copy(lora_step["step"], tmp_path / "careful", rank, rerecord=True)
    with pytest.raises(CheckpointError) as e:
        convert_checkpoint(careful, tmp_path / "out", **kwargs)
    assert str(e.value) == (f"{careful}/titanctl.json records LoRA rank 1,000,000,000, but the adapters of "
                            "layers.0.attention.wq have rank 4 (A (4, 256), B (256, 4))")
    assert not (tmp_path / "out").exists()


def test_to_peft_checks_the_recorded_base_as_merge_lora_does(lora_step, trained_run, tmp_path):
    """--to peft named whatever base the record said (fingerprint zeroed, path /etc) and exported."""
    def zeroed(meta):
        meta["lora"]["base"]["fingerprint"] = "sha256:files:" + "0" * 64

    def elsewhere(meta):
        meta["lora"]["base"]["path"] = str(tmp_path / "gone")

    step = edited_copy(lora_step["step"], tmp_path / "zeroed", zeroed, rerecord=True)
    with pytest.raises(CheckpointError, match="is not the one the adapters of .* were trained on"):
        convert_checkpoint(step, tmp_path / "out", dst_format="peft")
    step = edited_copy(lora_step["step"], tmp_path / "elsewhere", elsewhere, rerecord=True)
    with pytest.raises(CheckpointError, match=r"gone \(recorded in .*\), which the adapters of .* were trained on, "
                                              r"is missing \(moved\? .*--lora-base\)"):
        convert_checkpoint(step, tmp_path / "out", dst_format="peft")
    moved = tmp_path / "moved_base"
    shutil.copytree(lora_step["base"], moved)
    convert_checkpoint(step, tmp_path / "out", dst_format="peft", lora_base=moved)  # named where it is now
    assert json.loads((tmp_path / "out" / PEFT_CONFIG).read_text())["base_model_name_or_path"] == str(moved)
    other = tmp_path / "other_base"
    shutil.copytree(trained_run / "checkpoint" / "step-1", other)
    with pytest.raises(CheckpointError, match="is not the one the adapters of .* were trained on"):
        convert_checkpoint(lora_step["step"], tmp_path / "out2", dst_format="peft", lora_base=other)
    assert not (tmp_path / "out2").exists()


@pytest.mark.slow
def test_the_expert_bias_a_lora_run_moved_is_merged_from_the_step_and_peft_refuses_it(moe_lora_step, tmp_path):
    """The step holds the bias balancing moved while the base stayed frozen: --merge-lora writes it (not the
    base's); peft, which adapts the base's Hugging Face model (no bias), cannot carry it: refused in one line
    unless --drop-expert-bias, and so is --merge-lora --to hf."""
    from titanctl.checkpoint.lora.export import read_lora_step

    step = moe_lora_step["step"]
    moved = read_lora_step(step).buffers
    base, _ = load_checkpoint(moe_lora_step["base"])
    assert sorted(moved) == ["layers.0.moe.expert_bias", "layers.1.moe.expert_bias"]
    assert all(not torch.equal(moved[name], base[name]) for name in moved), "balancing moved no bias"
    convert_checkpoint(step, tmp_path / "merged", dst_format="dcp", merge_lora=True)
    merged, _ = load_checkpoint(tmp_path / "merged")
    assert all(torch.equal(merged[name], moved[name]) for name in moved)
    with pytest.raises(CheckpointError) as error:
        convert_checkpoint(step, tmp_path / "peft", dst_format="peft")
    message = str(error.value)
    assert message.startswith("layers.0.moe.expert_bias (and 1 more layers') holds trained values "
                              "(moe.load_balance_coeff) that peft cannot carry") and "\n" not in message
    assert "add --drop-expert-bias" in message and not (tmp_path / "peft").exists()
    with pytest.raises(CheckpointError, match="that the Hugging Face qwen3_moe format has no slot for: add --drop"):
        convert_checkpoint(step, tmp_path / "hf", dst_format="hf", merge_lora=True)
    report = convert_checkpoint(step, tmp_path / "peft", dst_format="peft", drop_expert_bias=True)
    assert any(note.startswith("--drop-expert-bias: the trained expert bias of 2 layers was left out (peft adapts")
               for note in report.notes), report.notes

"""peft's adapters into titanctl (``convert ADAPTER OUT --from peft --lora-base BASE``): the LoRA step it writes
gives the logits of ``PeftModel.from_pretrained`` on transformers' model of the base, merges into a folder with
those logits, converts back (``--to peft``) to the very tensors peft saved, and starts a LoRA run; titanctl's own
``--to peft`` reads back to its adapters bit for bit; what a titanctl LoRA checkpoint cannot hold is refused in
one line, leaving nothing on disk.

Adapters are made by peft (``get_peft_model``, every factor drawn at random, B too: at peft's init B is zero and
the adapter adds nothing to compare) on the session's trained Llama (its Hugging Face export) and on tiny random
Qwen3 and Qwen3-MoE models (the experts as peft ``target_parameters`` on transformers 5's packed experts).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.unit.checkpoint.test_lora_checkpoints import LORA_RUN
from tests.unit.checkpoint.test_lora_export import ours
from tests.unit.parallel.test_lora import CASES, QWEN3, QWEN3_MOE, hf_model, ours_with_lora
from titanctl.checkpoint.convert import convert_checkpoint, save_state_dict
from titanctl.checkpoint.lora.base import base_record
from titanctl.checkpoint.lora.export import PEFT_CONFIG, PEFT_WEIGHTS, read_adapters, write_peft
from titanctl.checkpoint.run.load_plan import plan_load
from titanctl.checkpoint.trust.metadata import read_metadata
from titanctl.config.recipe import load_config
from titanctl.errors import CheckpointError
from titanctl.models.registry import model_args_from_config
from titanctl.parallel.converters.lora import is_adapter
from titanctl.train.trainer import Trainer

TOL = 1e-5  # of the largest logit (fp32)
LR = 1e-4  # the run that trains on: one AdamW step moves each factor by about this much
# What each peft adapter targets: every RoPE layout's q/k rows, dense and packed experts.
MADE = {
    "llama3": dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
    "qwen3": dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "qwen3_moe": dict(target_modules=["q_proj", "v_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
}


def make_adapter(family: str, folder: Path, session_hf: Path) -> dict[str, Path]:
    """{base (a Hugging Face folder: the session's for llama3), adapter (peft's, of MADE[family], every factor
    random), step (titanctl's, read from it)}."""
    import transformers
    from peft import LoraConfig, get_peft_model

    folder.mkdir()
    if family == "llama3":
        base = session_hf
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    else:
        base = folder / "base"
        model = hf_model(transformers, QWEN3 if family == "qwen3" else QWEN3_MOE)
        model.save_pretrained(base)
    adapted = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, **MADE[family]))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    adapted.save_pretrained(folder / "peft")
    convert_checkpoint(folder / "peft", folder / "step", src_format="peft", lora_base=base)
    return {"base": base, "adapter": folder / "peft", "step": folder / "step"}


@pytest.fixture(scope="module")
def made(foreign_formats, tmp_path_factory):
    """family -> make_adapter's folders, made once per module."""
    root, cache = tmp_path_factory.mktemp("peft_import"), {}

    def get(family: str) -> dict[str, Path]:
        if family not in cache:
            cache[family] = make_adapter(family, root / family, foreign_formats["hf"])
        return cache[family]

    return get


@pytest.mark.parametrize("family", list(MADE))
def test_a_peft_adapter_gives_peft_logits_merges_and_converts_back_bitwise(made, tmp_path, family):
    import transformers
    from peft import PeftModel

    folders = made(family)
    meta = read_metadata(folders["step"])
    record = meta["lora"]
    assert (record["rank"], record["alpha"], meta["step"], meta["converted_from"]) == (8, 16.0, 0, "peft")
    assert record["base"] == base_record(folders["base"], "hf")
    convert_checkpoint(folders["step"], tmp_path / "merged", dst_format="hf", merge_lora=True)
    convert_checkpoint(folders["step"], tmp_path / "back", dst_format="peft")

    vocab = QWEN3.vocab_size if family != "llama3" else 4352
    ids = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(0))
    load = dict(dtype=torch.float32)
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(folders["base"], **load).eval()
        base_logits = base(ids).logits
        peft = PeftModel.from_pretrained(base, folders["adapter"]).eval()(ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", **load).eval()(ids).logits
        titanctl = ours(folders["step"], folders["base"])(ids)
    scale = peft.abs().max().item()
    moved = (peft - base_logits).abs().max().item()
    deltas = {"titanctl vs peft": (titanctl - peft).abs().max().item(),
              "merged vs peft": (merged - peft).abs().max().item()}
    print(f"\nPEFT IMPORT {family}: logits up to {scale:.1f}, the adapter moves them by up to {moved:.2f}; {deltas}")
    assert moved > 1000 * TOL * scale, "the adapter hardly changed the logits: the comparison has no teeth"
    for what, delta in deltas.items():
        assert delta <= TOL * scale, f"{what}: {delta:.3g}"

    theirs, back = load_file(folders["adapter"] / PEFT_WEIGHTS), load_file(tmp_path / "back" / PEFT_WEIGHTS)
    assert back.keys() == theirs.keys()
    for key, tensor in theirs.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


@pytest.mark.parametrize("case", list(CASES))
def test_titanctls_own_peft_export_reads_back_to_its_adapters_bit_for_bit(case, tmp_path):
    """The inverse of --to peft: the q/k row permutation, the packed experts of twice the rank."""
    import transformers

    args, cfg = CASES[case]
    model, adapters, record = ours_with_lora(hf_model(transformers, args), args, cfg)
    save_state_dict({k: v for k, v in model.state_dict().items() if not is_adapter(k)}, args, tmp_path / "base")
    (tmp_path / "peft").mkdir()
    write_peft(tmp_path / "peft", adapters, args, record, None)
    convert_checkpoint(tmp_path / "peft", tmp_path / "step", lora_base=tmp_path / "base")  # told by its files
    _, back_record, back = read_adapters(tmp_path / "step")
    assert {k: back_record[k] for k in record} == {**record, "alpha": float(record["alpha"])}
    assert back.keys() == adapters.keys()
    for name, tensor in adapters.items():
        assert torch.equal(back[name], tensor), name


def _edit(adapter: Path, to: Path, config: dict | None = None, tensors=None) -> Path:
    """A copy of ``adapter`` with ``config`` merged into its adapter_config.json and ``tensors(dict)`` applied
    to its weights."""
    shutil.copytree(adapter, to)
    if config is not None:
        text = json.loads((to / PEFT_CONFIG).read_text())
        (to / PEFT_CONFIG).write_text(json.dumps({**text, **config}))
    if tensors is not None:
        weights = load_file(to / PEFT_WEIGHTS)
        tensors(weights)
        save_file(weights, to / PEFT_WEIGHTS)
    return to


Q = "base_model.model.model.layers.0.self_attn.q_proj"


def _rank4_q(weights: dict) -> None:
    weights[f"{Q}.lora_A.weight"] = weights[f"{Q}.lora_A.weight"][:4].clone()
    weights[f"{Q}.lora_B.weight"] = weights[f"{Q}.lora_B.weight"][:, :4].clone()


REFUSED = {
    "dora": (dict(use_dora=True), None, "use_dora = True (DoRA"),
    "rank_pattern": (dict(rank_pattern={"layers.0.self_attn.q_proj": 4}), _rank4_q, "has rank 4 and scale 4, the adapter's r = 8 and "
                                                                 "scale 2 (rank_pattern / alpha_pattern"),
    "alpha_pattern": (dict(alpha_pattern={"layers.1.self_attn.v_proj": 32}), None,
                      "model.layers.1.self_attn.v_proj's adapter has rank 8 and scale 4"),
    "rank_pattern_not_the_tensors": (dict(rank_pattern={"k_proj": 16}), None, "gives it 16 (r, rank_pattern)"),
    "lora_bias": (dict(lora_bias=True), None, "lora_bias = True (a trained bias on lora_B)"),
    "bias": (dict(bias="all"), None, "bias = 'all' trains the base's biases"),
    "fan_in_fan_out": (dict(fan_in_fan_out=True), None, "fan_in_fan_out = True (transposed"),
    "modules_to_save": (dict(modules_to_save=["lm_head"]), None, "modules_to_save = ['lm_head'] (whole trained"),
    "another_method": (dict(peft_type="IA3"), None, "peft_type 'IA3' is not read"),
    "a_variant": (dict(use_bdlora={"target_modules_bd_a": ["q_proj"]}), None, "use_bdlora = {"),
    "embedding": (None, lambda w: w.update({"base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(8, 300)}),
                  "embed_tokens.lora_embedding_A is no lora_A / lora_B weight"),
    "no_slot": (None, lambda w: w.update({"base_model.model.model.norm.lora_A.weight": torch.ones(8, 64),
                                          "base_model.model.model.norm.lora_B.weight": torch.ones(64, 8)}),
                "the adapter on model.norm has no slot in titanctl's qwen3 model"),
    "one_factor": (None, lambda w: w.pop(f"{Q}.lora_B.weight"), "q_proj has no lora_B"),
    "tied_output": (None, lambda w: w.update({"base_model.model.lm_head.lora_A.weight": torch.ones(8, 64),
                                              "base_model.model.lm_head.lora_B.weight": torch.ones(256, 8)}),
                    "the adapter on lm_head adapts the output layer of a model whose output layer is its embedding"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_titanctl_cannot_represent_is_refused_in_one_line(made, tmp_path, case):
    config, tensors, message = REFUSED[case]
    folders = made("qwen3")
    adapter = _edit(folders["adapter"], tmp_path / "adapter", config, tensors)
    with pytest.raises(CheckpointError) as error:
        convert_checkpoint(adapter, tmp_path / "out", src_format="peft", lora_base=folders["base"])
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["adapter"]


def test_rslora_keeps_its_scale(made, tmp_path):
    """rsLoRA scales by lora_alpha / sqrt(r): the step's alpha is lora_alpha · sqrt(r), the logits peft's."""
    import transformers
    from peft import PeftModel

    folders = made("qwen3")
    adapter = _edit(folders["adapter"], tmp_path / "adapter", dict(use_rslora=True))
    report = convert_checkpoint(adapter, tmp_path / "step", lora_base=folders["base"])
    assert read_metadata(tmp_path / "step")["lora"]["alpha"] == 16 * math.sqrt(8)
    assert any(note.startswith("rsLoRA's scale lora_alpha / sqrt(r) is kept as alpha 45.25") for note in report.notes)
    ids = torch.randint(0, QWEN3.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(folders["base"], dtype=torch.float32).eval()
        peft = PeftModel.from_pretrained(base, adapter).eval()(ids).logits
        titanctl = ours(tmp_path / "step", folders["base"])(ids)
    assert (titanctl - peft).abs().max() <= TOL * peft.abs().max()


def test_a_base_another_model_files_missing_or_damaged_and_misused_options_are_refused(made, tmp_path):
    folders = made("qwen3")
    other = made("qwen3_moe")["base"]  # dim 64 too, other projections' shapes
    cases = {
        "made for another model": dict(src=folders["adapter"], lora_base=made("llama3")["base"]),
        "is missing (adapter_model.bin is PyTorch .bin": dict(src=_without_weights(folders["adapter"], tmp_path)),
        "is not a readable safetensors file": dict(src=_truncated(folders["adapter"], tmp_path)),
        "--from peft reads an adapter onto the model it was made for: give --lora-base": dict(
            src=folders["adapter"], lora_base=None),
        "--to hf does not apply to --from peft": dict(src=folders["adapter"], dst_format="hf"),
        "--merge-lora does not apply to --from peft": dict(src=folders["adapter"], merge_lora=True),
        "has no slot in titanctl's qwen3_moe model": dict(src=_only(folders["adapter"], tmp_path, "mlp.gate_proj"),
                                                          lora_base=other),
    }
    for message, kwargs in cases.items():
        kwargs = {"lora_base": folders["base"], **kwargs}
        with pytest.raises(CheckpointError) as error:
            convert_checkpoint(kwargs.pop("src"), tmp_path / "out", src_format="peft", **kwargs)
        assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
        assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match=r"is a peft adapter \(adapter_config.json\), not a model: bring it onto "
                                              r"its base first, `titanctl convert .* --from peft --lora-base BASE`"):
        convert_checkpoint(folders["adapter"], tmp_path / "out", src_format="hf")


def _without_weights(adapter: Path, tmp_path: Path) -> Path:
    out = tmp_path / "bin_only"
    shutil.copytree(adapter, out)
    (out / PEFT_WEIGHTS).rename(out / "adapter_model.bin")
    return out


def _truncated(adapter: Path, tmp_path: Path) -> Path:
    out = tmp_path / "truncated"
    shutil.copytree(adapter, out)
    data = (out / PEFT_WEIGHTS).read_bytes()
    (out / PEFT_WEIGHTS).write_bytes(data[: len(data) // 2])
    return out


def _only(adapter: Path, tmp_path: Path, module: str) -> Path:
    """The adapter's factors on ``module`` alone (a dense feed-forward, which the MoE model has not)."""
    return _edit(adapter, tmp_path / "only", None,
                 lambda w: [w.pop(k) for k in list(w) if f".{module}." not in k])


def test_a_lora_run_starts_from_the_adapter_and_trains_it_on(made, tmp_path, capsys):
    folders = made("llama3")
    _, record, imported = read_adapters(folders["step"])
    run = [*LORA_RUN, "--lora.rank", "8", "--lora.alpha", "16", "--lora.target_modules", "attention,feed_forward.w2",
           "--optimizer.lr", str(LR), "--optimizer.weight_decay", "0", "--training.steps", "1",
           "--checkpoint.interval", "1", "--checkpoint.initial_load_path", str(folders["step"])]
    Trainer(load_config(None, [*run, "--job.dump_folder", str(tmp_path / "run")])).train()
    assert f"loaded initial checkpoint {folders['step']} (step 0): model" in capsys.readouterr().out
    step = tmp_path / "run" / "checkpoint" / "step-1"
    _, trained_record, trained = read_adapters(step)
    assert trained_record["base"] == record["base"]  # the base the adapter was made on, not the adapter's step
    assert trained.keys() == imported.keys()
    moved = max((trained[n] - imported[n]).abs().max().item() for n in imported)
    size = min(imported[n].abs().max().item() for n in imported)
    assert 0 < moved <= 2 * LR < size / 100, (moved, size)  # one optimizer step from the adapter, not from B = 0

    def plan(*extra):
        cfg = load_config(None, [*run, *extra, "--job.dump_folder", str(tmp_path / "other")])
        return plan_load(cfg, model_args_from_config(cfg.model, 1, cfg.training.seq_len))

    with pytest.raises(CheckpointError, match=r"holds adapters of rank 8 on 10 modules, this run's lora settings make "
                                              r"rank 4 on 10: train them on with lora.rank = 8 and lora.target_modules "
                                              r"= attention.wk,attention.wo,attention.wq,attention.wv,feed_forward.w2"):
        plan("--lora.rank", "4")
    with pytest.raises(CheckpointError, match="holds LoRA adapters only .* or train the adapters on with lora.enable"):
        plan("--lora.enable", "false")

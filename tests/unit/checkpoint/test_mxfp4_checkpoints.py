"""gpt-oss's published MXFP4 weights (``mlp.experts.{gate_up,down}_proj_blocks`` uint8 (E, rows, G, 16) beside
``_scales`` uint8 (E, rows, G), ``quantization_config.quant_method: mxfp4``) are read by ``convert`` and
``checkpoint.initial_load_path``: each matrix becomes its FP4 E2M1 values (low nibble first) times
2^(scale - 127), exactly, one tensor at a time, with its last two dimensions swapped as transformers holds
it; a malformed block or scale tensor is refused in one line before anything is written.

The folder is written here in the published layout from known weights: random FP4 codes and exponents whose
values (bfloat16, exact) come from an independent decoding written below from E2M1's definition."""

from __future__ import annotations

import json
import re
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import titanctl.checkpoint.formats.hf as hf_format
from tests.unit.checkpoint.test_checkpoint_trust import cli
from tests.unit.models.families import gpt_oss_model
from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint, open_checkpoint
from titanctl.checkpoint.hf.names import args_from_hf_config
from titanctl.checkpoint.quantized import mxfp4
from titanctl.checkpoint.run.load_into_model import load_source_into
from titanctl.checkpoint.run.load_plan import ForeignPlan, plan_load
from titanctl.checkpoint.weights import find_checkpoint
from titanctl.config.recipe import load_config
from titanctl.errors import CheckpointError
from titanctl.models.registry import build_model

PROJECTIONS = ("gate_up_proj", "down_proj")


def e2m1(code: int) -> float:
    """An FP4 E2M1 code's value from the format's definition: sign bit, 2 exponent bits (bias 1), 1 mantissa
    bit; exponent 0 is subnormal (0 or 0.5)."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    return sign * (mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1))


def reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(..., rows, G, 16), (..., rows, G) -> (..., rows, G x 32) in float64: byte j of a block holds
    values 2j (low nibble) and 2j + 1 (high nibble)."""
    table = torch.tensor([e2m1(c) for c in range(16)], dtype=torch.float64)
    low, high = table[(blocks % 16).long()], table[(blocks // 16).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # (..., rows, G, 32)
    return (values * torch.pow(2.0, scales.double() - 127)[..., None]).flatten(-2)


def random_packed(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks and scales encoding a (E, rows, cols) matrix stack: random codes, exponents around 2^0."""
    *lead, rows, cols = shape
    blocks = torch.randint(0, 256, (*lead, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 131, (*lead, rows, cols // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


class Folder:
    def __init__(self, path: Path, known: dict[str, torch.Tensor], args) -> None:
        self.path, self.known, self.args = path, known, args


def write_mxfp4_folder(folder: Path, theirs, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The model's state as the published checkpoints store it: experts' matrices MXFP4 (random known
    weights), everything else bfloat16, over two files with an index; config.json declaring mxfp4. Returns
    the known weights by Hugging Face name in transformers' layout (E, in, out), bfloat16."""
    folder.mkdir()
    tensors, known = {}, {}
    for name, tensor in theirs.state_dict().items():
        if name.endswith(PROJECTIONS):
            rows_cols = tensor.shape[0], tensor.shape[2], tensor.shape[1]  # published: (E, out, in)
            blocks, scales = random_packed(rows_cols, gen)
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            known[name] = reference(blocks, scales).to(torch.bfloat16).mT
        else:
            tensors[name] = tensor.to(torch.bfloat16).contiguous()
    names = sorted(tensors)
    files = {name: f"model-0000{1 + (i % 2)}-of-00002.safetensors" for i, name in enumerate(names)}
    for file in set(files.values()):
        save_file({n: tensors[n] for n in names if files[n] == file}, str(folder / file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))
    config = json.loads(theirs.config.to_json_string())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    return known


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Folder:
    theirs = gpt_oss_model(intermediate_size=64)  # every contraction width a multiple of 32
    path = tmp_path_factory.mktemp("mxfp4") / "hf"
    known = write_mxfp4_folder(path, theirs, torch.Generator().manual_seed(0))
    return Folder(path, known, args_from_hf_config(json.loads((path / "config.json").read_text())))


def experts_of(state: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    return {"gate_up_proj": state[f"layers.{layer}.moe.experts.w13"].mT, "down_proj": state[f"layers.{layer}.moe.experts.w2"].mT}


def test_the_folder_holds_the_published_layout(folder):
    stored = {}
    for path in folder.path.glob("*.safetensors"):
        stored.update(load_file(path))
    blocks = stored["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    scales = stored["model.layers.0.mlp.experts.gate_up_proj_scales"]
    assert blocks.dtype == scales.dtype == torch.uint8
    assert blocks.shape == (8, 128, 2, 16) and scales.shape == (8, 128, 2)  # (E, 2 x hidden, dim / 32, 16)
    assert stored["model.layers.0.mlp.experts.down_proj_blocks"].shape == (8, 64, 2, 16)  # (E, dim, hidden / 32, 16)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in stored
    # The independent decoding agrees with transformers' own (integrations/mxfp4.py).
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert torch.equal(theirs, folder.known["model.layers.0.mlp.experts.gate_up_proj"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_convert_dequantizes_exactly(folder, tmp_path, dtype):
    report = convert_checkpoint(folder.path, tmp_path / "dcp", dtype="bf16" if dtype == torch.bfloat16 else "fp32")
    assert any(f"8 MXFP4 weights (*_blocks, *_scales) dequantized exactly to {str(dtype)[6:]}" in n
               for n in report.notes), report.notes
    state, args = load_checkpoint(tmp_path / "dcp")
    assert args == folder.args.replace(max_seq_len=args.max_seq_len)
    assert not any("blocks" in name or "scales" in name for name in state)
    for layer in range(args.n_layers):
        for proj, tensor in experts_of(state, layer).items():
            want = folder.known[f"model.layers.{layer}.mlp.experts.{proj}"].to(dtype)
            assert tensor.dtype == dtype and torch.equal(tensor, want), (layer, proj)


def test_hf_export_of_the_dequantized_folder_loads_in_transformers(folder, tmp_path):
    import transformers

    convert_checkpoint(folder.path, tmp_path / "out", dst_format="hf", dtype="fp32")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config
    model = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    for layer in range(folder.args.n_layers):
        experts = model.model.layers[layer].mlp.experts
        for proj in PROJECTIONS:
            assert torch.equal(getattr(experts, proj), folder.known[f"model.layers.{layer}.mlp.experts.{proj}"].float())


def test_initial_load_path_fills_the_model(folder, tmp_path):
    cfg = load_config(None, ["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.initial_load_path",
                             str(folder.path)])
    args = folder.args.replace(max_seq_len=64)
    plan = plan_load(cfg, args)
    assert isinstance(plan, ForeignPlan) and plan.format == "hf"
    model = build_model(args)
    with plan.source as source:
        report = load_source_into(model, source)
    assert not report.not_in_model
    state = model.state_dict()
    for layer in range(args.n_layers):
        for proj, tensor in experts_of(state, layer).items():
            assert torch.equal(tensor, folder.known[f"model.layers.{layer}.mlp.experts.{proj}"].float())


def test_dequantization_is_lazy_one_tensor_at_a_time(folder, monkeypatch):
    loading: list[str | None] = [None]
    calls: list[str | None] = []
    live, peak = [0], [0]
    real_dequantize, real_load = mxfp4.dequantize, hf_format.HFSource.load

    def tracked_dequantize(*args, **kwargs):
        calls.append(loading[0])
        return real_dequantize(*args, **kwargs)

    def tracked_load(self, name):
        loading[0] = name
        before = len(calls)
        tensor = real_load(self, name)
        loading[0] = None
        if len(calls) > before:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            weakref.finalize(tensor, lambda: live.__setitem__(0, live[0] - 1))
        return tensor

    monkeypatch.setattr(mxfp4, "dequantize", tracked_dequantize)
    monkeypatch.setattr(hf_format.HFSource, "load", tracked_load)
    with open_checkpoint(folder.path, dequantize_to=torch.bfloat16) as source:
        assert calls == [], "dequantized while opening"
        for _name, tensor in source.iter_tensors():
            del tensor
    assert sorted(calls) == sorted(f"layers.{i}.moe.experts.{w}" for i in range(4) for w in ("w13", "w2"))
    assert peak[0] == 1 and live[0] == 0


def test_dequantize_equals_the_reference_in_chunks(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    blocks, scales = random_packed((3, 70, 96), gen)
    scales[0, 0, 0], scales[1, 2, 1] = 0, 254  # the smallest exponent (2^-127: subnormal) and the largest
    blocks[1, 2, 1] = 0x11  # 0.5 x 2^127, finite
    monkeypatch.setattr(mxfp4, "ROWS_PER_CHUNK", 64)  # rows in several chunks, the last one partial
    for dtype in (torch.float32, torch.bfloat16):
        got = mxfp4.dequantize(blocks, scales, dtype, "w")
        assert got.dtype == dtype and torch.equal(got, reference(blocks, scales).to(dtype)), dtype
        assert torch.equal(got.double(), reference(blocks, scales)), "not exact"


# ----------------------------------------------------------------------------- refusals

KEY = "model.layers.1.mlp.experts.down_proj"


def broken(folder: Folder, tmp_path: Path, how: str) -> tuple[Path, str]:
    """A copy of the folder damaged in one way, and the error it must give."""
    path = tmp_path / f"broken-{how}"
    shutil.copytree(folder.path, path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    file = path / index["weight_map"][f"{KEY}_blocks"]
    scales_file = path / index["weight_map"][f"{KEY}_scales"]
    by_file = {f: load_file(f) for f in {file, scales_file}}
    blocks, scales = by_file[file][f"{KEY}_blocks"], by_file[scales_file][f"{KEY}_scales"]
    if how == "blocks-dtype":
        by_file[file][f"{KEY}_blocks"] = blocks.to(torch.int16)
        message = rf"tensor '{KEY}_blocks' is int16: MXFP4 blocks are uint8"
    elif how == "scales-dtype":
        by_file[scales_file][f"{KEY}_scales"] = scales.float()
        message = rf"tensor '{KEY}_scales' is float32: MXFP4 scales are uint8"
    elif how == "blocks-shape":
        by_file[file][f"{KEY}_blocks"] = blocks[..., :8].contiguous()
        message = rf"MXFP4 tensor '{KEY}_blocks' in .* has shape \(8, 64, 2, 8\), expected \(..., rows, blocks, 16\)"
    elif how == "scales-shape":
        by_file[scales_file][f"{KEY}_scales"] = scales[:, :, :1].contiguous()
        message = rf"tensor '{KEY}_scales' has shape \(8, 64, 1\), but '{KEY}_blocks' of shape \(8, 64, 2, 16\) needs"
    elif how == "missing-scales":
        del by_file[scales_file][f"{KEY}_scales"]
        del index["weight_map"][f"{KEY}_scales"]
        message = rf"MXFP4 tensor '{KEY}_blocks' .*has no '{KEY}_scales'"
    elif how == "orphan-scales":
        del by_file[file][f"{KEY}_blocks"]
        del index["weight_map"][f"{KEY}_blocks"]
        message = rf"tensor '{KEY}_scales' .* holds MXFP4 scales of '{KEY}_blocks', which the checkpoint lacks"
    elif how == "scale-nan":
        scales = scales.clone()
        scales[3, 5, 1] = 255
        by_file[scales_file][f"{KEY}_scales"] = scales
        message = rf"tensor '{KEY}_scales' in .* holds 255 at block \(3, 5, 1\): E8M0's NaN, an MXFP4 scale out of range"
    elif how == "decodes-to-inf":  # 6 x 2^127 exceeds float32's and bfloat16's largest value
        scales, blocks = scales.clone(), blocks.clone()
        scales[2, 7, 0], blocks[2, 7, 0, 3] = 254, 0x70
        by_file[scales_file][f"{KEY}_scales"], by_file[file][f"{KEY}_blocks"] = scales, blocks
        message = rf"MXFP4 tensor '{KEY}' decodes to a value that is not finite in bfloat16 at block \(2, 7, 0\)"
    elif how == "sinks-nan":  # a tensor beside the blocks (issue 57: its NaN was copied)
        sinks_key = "model.layers.0.self_attn.sinks"
        sinks_file = path / index["weight_map"][sinks_key]
        tensors = by_file.setdefault(sinks_file, load_file(sinks_file))
        tensors[sinks_key] = tensors[sinks_key].clone()
        tensors[sinks_key][1] = float("nan")
        message = rf"tensor '{sinks_key}' holds a value that is not finite \(NaN or infinity\)"
    elif how == "undeclared":
        config = json.loads((path / "config.json").read_text())
        del config["quantization_config"]
        (path / "config.json").write_text(json.dumps(config))
        message = r"tensor '.*_blocks' in .* is MXFP4 blocks, but config.json does not declare .*'mxfp4'"
    for f, tensors in by_file.items():
        save_file(tensors, str(f))
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path, message


REFUSALS = ("blocks-dtype", "scales-dtype", "blocks-shape", "scales-shape", "missing-scales", "orphan-scales",
            "scale-nan", "decodes-to-inf", "sinks-nan", "undeclared")


@pytest.mark.parametrize("how", REFUSALS)
def test_a_malformed_mxfp4_folder_is_refused_in_one_line(folder, tmp_path, capsys, how):
    src, message = broken(folder, tmp_path, how)
    with pytest.raises(CheckpointError, match=message):
        convert_checkpoint(src, tmp_path / "api")
    (tmp_path / "dst").mkdir()
    proc = cli(["convert", src, tmp_path / "dst", "--to", "hf", "--dtype", "bf16"], capsys)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    line = proc.stderr.strip()
    assert "\n" not in line and line.startswith("error:") and "Traceback" not in proc.stderr + proc.stdout, line
    assert re.search(message, line), line
    assert list((tmp_path / "dst").iterdir()) == [] and not (tmp_path / "api").exists()
    assert not list(tmp_path.glob(".*partial*"))
    if how not in ("decodes-to-inf", "sinks-nan"):  # found from the headers and scales, before the model is built
        cfg = load_config(None, ["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.initial_load_path",
                                 str(src)])
        with pytest.raises(CheckpointError, match=message):
            plan_load(cfg, folder.args.replace(max_seq_len=64))
        with pytest.raises(CheckpointError, match=message):
            find_checkpoint(src)


def test_float16_is_refused_for_mxfp4(folder, tmp_path):
    with pytest.raises(CheckpointError, match="MXFP4 weights dequantize exactly to float32 or bfloat16, not float16"):
        convert_checkpoint(folder.path, tmp_path / "out", dtype="fp16")

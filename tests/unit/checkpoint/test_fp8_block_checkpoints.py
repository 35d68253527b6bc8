"""DeepSeek-V3's official block-FP8 Hugging Face weights (``X.weight`` in float8_e4m3fn beside
``X.weight_scale_inv``, one float32 scale per block of ``quantization_config.weight_block_size``) are read by
``convert`` and ``checkpoint.initial_load_path``: each weight becomes ``weight.float() * its block's scale``
rounded once to the dtype asked, bit for bit, one tensor at a time; the scales never become weights; a scale
that does not fit its weight, a weight without scales, scales without a weight and an unknown quantization
method are refused in one line before anything is written.

The folders are built here from a tiny transformers ``DeepseekV3ForCausalLM`` whose dimensions are not
multiples of the block (partial blocks at every edge), quantized block-wise by an independent reference.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import weakref
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import titanctl.checkpoint.formats.hf as hf_format
from tests.unit.checkpoint.test_checkpoint_trust import cli
from tests.unit.hf_reference import per_expert_layout, unit_scale_
from tests.unit.models.families import deepseek_v3_config
from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint, open_checkpoint
from titanctl.checkpoint.hf.names import args_from_hf_config, from_hf_state_dict, to_hf_state_dict
from titanctl.checkpoint.quantized.fp8_blocks import dequantize
from titanctl.checkpoint.run.load_into_model import load_source_into
from titanctl.checkpoint.run.load_plan import ForeignPlan, plan_load
from titanctl.checkpoint.weights import find_checkpoint
from titanctl.config.recipe import load_config
from titanctl.errors import CheckpointError
from titanctl.models.registry import build_model

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# Tiny DeepSeek-V3 whose widths are no multiple of 16 or 32: hidden 72, dense FFN 100, experts 40 wide (their
# gate_up_proj 80 rows: the gate/up boundary cuts a 16-row block), q LoRA 52, KV latent 36 (+16 rope = 52).
DIMS = dict(hidden_size=72, intermediate_size=100, moe_intermediate_size=40, q_lora_rank=52, kv_lora_rank=36,
            num_hidden_layers=3, tie_word_embeddings=False)
VARIANTS = {  # block size in config.json (None: the key absent, DeepSeek's default 128) and expert layout
    "16x16-per_expert": ([16, 16], "per_expert"),
    "8x32-per_expert": ([8, 32], "per_expert"),  # not square: rows and columns cannot be swapped unnoticed
    "default128-per_expert": (None, "per_expert"),
    "16x16-packed": ([16, 16], "packed"),  # transformers 5's packed experts with gate_up_proj_scale_inv
}


# ----------------------------------------------------------------------------- the reference quantization


def expand(scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """Each scale over its block of rows x cols, cut to the weight's size."""
    return scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)[..., :rows, :cols]


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 scales): each block's largest |w| maps to the largest FP8 value."""
    *lead, rows, cols = w.shape
    n_rows, n_cols = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    padded = torch.zeros(*lead, n_rows * block[0], n_cols * block[1])
    padded[..., :rows, :cols] = w
    blocks = padded.unflatten(-1, (n_cols, block[1])).unflatten(-3, (n_rows, block[0]))  # (..., nR, b0, nC, b1)
    scale = (blocks.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp(min=1e-12).float()  # (..., nR, nC)
    return (w / expand(scale, block, rows, cols)).to(FP8), scale


def reference(fp8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """DeepSeek's weight_dequant: float32 product of the weight and its block's scale."""
    return fp8.float() * expand(scale, block, *fp8.shape[-2:])


def quantized_names(name: str) -> bool:
    """What DeepSeek-V3's release stores in FP8: every projection (attention, dense and expert FFNs); not the
    embedding, output layer, norms, router gate or expert bias."""
    if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return True
    unquantized = ("model.embed_tokens.weight", "lm_head.weight", "layernorm.weight", "model.norm.weight",
                   "mlp.gate.weight", "e_score_correction_bias")
    return name.endswith(".weight") and not name.endswith(unquantized)


def write_fp8_folder(folder: Path, hf_state: dict, config: dict, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """`hf_state` as the official release stores it: projections FP8 + scales, the rest bf16 (expert bias
    fp32); weights in one file, scales in another (so a weight's scales are read from another file), with an
    index. Returns the reference: each tensor as it should read, FP8 ones dequantized in float32."""
    folder.mkdir()
    weights, scales, expected = {}, {}, {}
    for name, tensor in hf_state.items():
        if quantized_names(name):
            fp8, scale = quantize(tensor.float(), block)
            weights[name], scales[f"{name}_scale_inv"] = fp8, scale
            expected[name] = reference(fp8, scale, block)
        else:
            keep = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
            weights[name] = expected[name] = tensor.to(keep).contiguous()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model-00001-of-00002.safetensors"))
    save_file(scales, str(folder / "model-00002-of-00002.safetensors"))
    weight_map = {**dict.fromkeys(weights, "model-00001-of-00002.safetensors"),
                  **dict.fromkeys(scales, "model-00002-of-00002.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config))
    return expected


@pytest.fixture(scope="module")
def theirs():
    import transformers

    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(deepseek_v3_config(**DIMS)).eval()
    unit_scale_(model, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=torch.Generator().manual_seed(1)))
    return model


def fp8_config(theirs, block: list[int] | None, **quantization) -> dict:
    config = json.loads(theirs.config.to_json_string())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     **({"weight_block_size": block} if block else {}), **quantization}
    return config


class Folder:
    def __init__(self, path: Path, expected_hf: dict, args, block: tuple[int, int], layout: str) -> None:
        self.path, self.args, self.block, self.layout = path, args, block, layout
        self.expected_hf = expected_hf  # Hugging Face names, FP8 weights dequantized in float32

    def expected(self, fp8_dtype: torch.dtype | None, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """titanctl's names: the FP8 weights in `fp8_dtype`, every tensor cast to `dtype` when given."""
        cast = {k: v.to(fp8_dtype) if quantized_names(k) and fp8_dtype else v for k, v in self.expected_hf.items()}
        ours = from_hf_state_dict(cast, self.args)
        return {k: v.to(dtype) if dtype else v for k, v in ours.items()}


@pytest.fixture(scope="module", params=list(VARIANTS))
def folder(request, theirs, tmp_path_factory) -> Folder:
    block, layout = VARIANTS[request.param]
    state = theirs.state_dict()
    config = fp8_config(theirs, block)
    args = args_from_hf_config(config)
    if layout == "per_expert":
        state = per_expert_layout(state, args.moe.hidden_dim)
    path = tmp_path_factory.mktemp(request.param) / "hf"
    effective = tuple(block or (128, 128))
    return Folder(path, write_fp8_folder(path, state, config, effective), args, effective, layout)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, (name, got[name].dtype, want[name].dtype)
        assert torch.equal(got[name], want[name]), name




# ----------------------------------------------------------------------------- reading and converting


def test_the_folder_has_partial_blocks_fp8_weights_and_scales(folder):
    stored = {}
    for path in folder.path.glob("*.safetensors"):
        stored.update(load_file(path))
    scales = [k for k in stored if k.endswith("_scale_inv")]
    assert scales and all(stored[k.removesuffix("_scale_inv")].dtype == FP8 for k in scales)
    a_proj = stored["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]  # (52, 72)
    assert a_proj.dtype == FP8 and a_proj.shape == (52, 72)
    assert a_proj.shape[0] % folder.block[0] and a_proj.shape[1] % folder.block[1], "no partial block"
    assert stored["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16
    assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16


def test_convert_to_dcp_gives_the_dequantized_weights_in_bf16_by_default(folder, tmp_path):
    report = convert_checkpoint(folder.path, tmp_path / "dcp")
    assert any("FP8 weights dequantized to bfloat16" in note for note in report.notes), report.notes
    state, args = load_checkpoint(tmp_path / "dcp")
    assert args == folder.args.replace(max_seq_len=args.max_seq_len)
    want = folder.expected(torch.bfloat16)
    assert_same(state, want)
    # The tensors that were never FP8 (embedding, norms, router gate, output, expert bias) pass unchanged.
    stored = load_file(folder.path / "model-00001-of-00002.safetensors")
    for name, hf_name in (("tok_embeddings.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight"),
                          ("output.weight", "lm_head.weight"), ("layers.1.moe.router.gate.weight",
                                                                "model.layers.1.mlp.gate.weight"),
                          ("layers.0.attention.kv_norm.weight", "model.layers.0.self_attn.kv_a_layernorm.weight"),
                          ("layers.1.moe.expert_bias", "model.layers.1.mlp.gate.e_score_correction_bias")):
        assert state[name].dtype == stored[hf_name].dtype and torch.equal(state[name], stored[hf_name]), name
    assert not any("scale" in name for name in state)
    assert not list(tmp_path.glob(".dcp.partial-*"))


def test_cli_convert_to_hf_in_fp32_is_the_float32_product_bit_for_bit(folder, tmp_path, capsys):
    proc = cli(["convert", folder.path, tmp_path / "out", "--to", "hf", "--dtype", "fp32"], capsys)
    assert proc.returncode in (0, None), proc.stderr
    assert proc.stdout.startswith("hf → hf:") and "dequantized to float32" in proc.stdout, proc.stdout
    written = {}
    for path in (tmp_path / "out").glob("*.safetensors"):
        written.update(load_file(path))
    assert_same(written, to_hf_state_dict(folder.expected(None, torch.float32), folder.args))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "float32"


def test_python_api_to_hf_in_bf16_and_back(folder, tmp_path):
    convert_checkpoint(folder.path, tmp_path / "out", dst_format="hf", dtype="bf16")
    state, _ = load_checkpoint(tmp_path / "out")
    assert_same(state, folder.expected(torch.bfloat16, torch.bfloat16))


def test_initial_load_path_fills_the_model_in_its_own_dtype(folder, tmp_path):
    cfg = load_config(None, ["--job.dump_folder", str(tmp_path / "run"),
                             "--checkpoint.initial_load_path", str(folder.path)])
    args = folder.args.replace(max_seq_len=64)
    for dtype in (torch.float32, torch.bfloat16):
        plan = plan_load(cfg, args)
        assert isinstance(plan, ForeignPlan) and plan.format == "hf"
        model = build_model(args).to(dtype)
        with plan.source as source:
            report = load_source_into(model, source)
        assert not report.not_in_model
        want = folder.expected(None, dtype)  # float32 product, rounded once to the model's dtype
        assert_same({k: v for k, v in model.state_dict().items() if k in want}, want)


def test_dequantization_is_lazy_one_tensor_at_a_time(folder, monkeypatch):
    """Opening and checking dequantizes nothing; each weight is dequantized while it is loaded, from its own
    FP8 tensors only (one, or one per expert), and no loaded weight is kept by the reader: a reader that
    dequantized everything up front, ahead of time, or kept its results would fail here."""
    loading: list[str | None] = [None]
    calls: list[str | None] = []  # the weight being loaded at each dequantize call
    live, peak = [0], [0]

    def tracked_dequantize(*args, **kwargs):
        calls.append(loading[0])
        return dequantize(*args, **kwargs)

    real_load = hf_format.HFSource.load

    def tracked_load(self, name):
        loading[0] = name
        calls_before = len(calls)
        tensor = real_load(self, name)
        loading[0] = None
        if len(calls) > calls_before:  # a dequantized weight: count it until it is freed
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            weakref.finalize(tensor, lambda: live.__setitem__(0, live[0] - 1))
        return tensor

    monkeypatch.setattr(hf_format, "dequantize", tracked_dequantize)
    monkeypatch.setattr(hf_format.HFSource, "load", tracked_load)
    fp16 = set()  # float16: what the FP8 weights become here, and nothing else in the folder is
    with open_checkpoint(folder.path, dequantize_to=torch.float16) as source:
        assert calls == [], "dequantized while opening"
        for name, tensor in source.iter_tensors():
            fp16.update([name] if tensor.dtype == torch.float16 else [])
            del tensor  # a streaming consumer (a writer) lets each go
        experts = source.args.moe.num_experts
    assert None not in calls and peak[0] == 1 and live[0] == 0, (peak[0], live[0])
    assert set(calls) == fp16 and len(fp16) > 10
    for name, count in Counter(calls).items():
        assert count == (experts if folder.layout == "per_expert" and ".moe.experts." in name else 1), (name, count)


def test_dequantize_rounds_once_from_the_float32_product():
    gen = torch.Generator().manual_seed(0)
    for shape, block in (((37, 50), (16, 16)), ((3, 37, 50), (8, 32)), ((20, 7), (128, 128))):
        fp8 = torch.randn(shape, generator=gen).to(FP8)
        rows, cols = shape[-2:]
        scale = torch.rand(*shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]), generator=gen) + 0.1
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            got = dequantize(fp8, scale, block, dtype)
            assert got.dtype == dtype and torch.equal(got, reference(fp8, scale, block).to(dtype)), (shape, dtype)


# ----------------------------------------------------------------------------- refusals


def broken(folder: Folder, tmp_path: Path, how: str) -> tuple[Path, str]:
    """A copy of the folder damaged in one way, and the error it must give."""
    path = tmp_path / f"broken-{how}"
    shutil.copytree(folder.path, path)
    scales_file = path / "model-00002-of-00002.safetensors"
    index_file = path / "model.safetensors.index.json"
    scales = load_file(scales_file)
    index = json.loads(index_file.read_text())
    key = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"  # of a (52, 72) weight
    if how == "scale-shape":
        good = tuple(scales[key].shape)
        scales[key] = torch.ones(good[0] + 1, good[1])
        message = (rf"'{key}' in model-00002-of-00002.safetensors has shape \({good[0] + 1}, {good[1]}\), but "
                   rf"'{key.removesuffix('_scale_inv')}' of shape \(52, 72\) needs \({good[0]}, {good[1]}\)")
    elif how == "missing-scale":
        del scales[key]
        del index["weight_map"][key]
        message = rf"FP8 tensor '{key.removesuffix('_scale_inv')}' .*\(shape \(52, 72\)\) has no '{key}'"
    elif how == "orphan-scale":
        orphan = "model.layers.0.self_attn.kv_a_proj.weight_scale_inv"
        scales[orphan] = torch.ones(1, 1)
        index["weight_map"][orphan] = scales_file.name
        message = rf"'{orphan}' .*\(shape \(1, 1\)\) scales 'model.layers.0.self_attn.kv_a_proj.weight', which the " \
                  "checkpoint lacks"
    elif how == "unknown-method":
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"]["quant_method"] = "awq"
        (path / "config.json").write_text(json.dumps(config))
        message = r"quantization_config.quant_method 'awq' is not supported; titanctl reads 'fp8'"
    elif how in SCALE_VALUES:  # issue 47: each converted with exit code 0 into NaN, inf, zero or negated weights
        value, makes = SCALE_VALUES[how]
        scales[key] = scales[key].clone()
        rows, cols = scales[key].shape  # the last block: a partial one, and (0, 0) with 128x128 blocks
        scales[key][-1, -1] = value
        message = (rf"'{key}' in model-00002-of-00002.safetensors holds {value} at block \({rows - 1}, {cols - 1}\): "
                   rf"a block scale "
                   rf"must be finite and > 0, else '{key.removesuffix('_scale_inv')}' dequantizes to {makes}")
    elif how == "scale-int64":  # issue 47: read as integers, an all-zero expert
        scales[key] = torch.ones(scales[key].shape, dtype=torch.int64)
        message = rf"'{key}' in model-00002-of-00002.safetensors is int64: block scales are real numbers"
    elif how == "config-nan":  # issue 46: beside rope_parameters' theta, which is read, so it passed unseen
        config = json.loads((path / "config.json").read_text())
        config["rope_theta"] = float("nan")  # json writes NaN, which JSON does not allow and Python reads
        (path / "config.json").write_text(json.dumps(config))
        message = r"config.json: 'rope_theta' is nan: a config's numbers must be finite"
    save_file(scales, str(scales_file))
    index_file.write_text(json.dumps(index))
    return path, message


SCALE_VALUES = {"scale-nan": (float("nan"), "NaN weights"), "scale-inf": (float("inf"), "infinite weights"),
                "scale-zero": (0.0, "zeros"), "scale-negative": (-1.0, "negated weights")}
REFUSALS = ("scale-shape", "missing-scale", "orphan-scale", "unknown-method", *SCALE_VALUES, "scale-int64",
            "config-nan")


@pytest.mark.parametrize("how", REFUSALS)
def test_a_broken_fp8_folder_is_refused_in_one_line_before_anything_is_written(folder, tmp_path, capsys, how):
    src, message = broken(folder, tmp_path, how)
    with pytest.raises(CheckpointError, match=message):
        convert_checkpoint(src, tmp_path / "api")
    # The CLI: one red line, exit code 2, no traceback; an existing (empty) destination is left as it was.
    (tmp_path / "dst").mkdir()
    (tmp_path / "beside.txt").write_text("kept")
    proc = cli(["convert", src, tmp_path / "dst", "--to", "hf", "--dtype", "bf16"], capsys)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    line = proc.stderr.strip()
    assert "\n" not in line and line.startswith("error:") and "Traceback" not in proc.stderr + proc.stdout, line
    assert re.search(message, line), line
    assert list((tmp_path / "dst").iterdir()) == [] and (tmp_path / "beside.txt").read_text() == "kept"
    assert not list(tmp_path.glob(".*partial*")) and not (tmp_path / "api").exists()
    # initial_load_path: refused when the run plans its load, before the model is built.
    cfg = load_config(None, ["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.initial_load_path", str(src)])
    with pytest.raises(CheckpointError, match=message):
        plan_load(cfg, folder.args.replace(max_seq_len=64))
    # infer-tp: refused when it reads the folder's model, before the model is built (the same reader).
    with pytest.raises(CheckpointError, match=message):
        find_checkpoint(src)


def test_an_expert_that_is_not_fp8_among_fp8_ones_is_named_with_its_dtype(theirs, tmp_path):
    """Issue 46: one expert stored in float32 (it held inf, which float8_e4m3fn cannot) without scales was
    refused as "not one of each of 8 experts with equal shapes": the fault is its dtype, and is said so."""
    config = fp8_config(theirs, [16, 16])
    state = per_expert_layout(theirs.state_dict(), args_from_hf_config(config).moe.hidden_dim)
    write_fp8_folder(tmp_path / "hf", state, config, (16, 16))
    weights_file, scales_file = (tmp_path / "hf" / f"model-0000{i}-of-00002.safetensors" for i in (1, 2))
    weights, scales = load_file(weights_file), load_file(scales_file)
    odd = "model.layers.1.mlp.experts.3.up_proj.weight"
    weights[odd] = torch.full(weights[odd].shape, float("inf"))
    del scales[f"{odd}_scale_inv"]
    save_file(weights, str(weights_file))
    save_file(scales, str(scales_file))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    del index["weight_map"][f"{odd}_scale_inv"]
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    message = (rf"expert tensor '{odd}' is \(40, 72\) float32, but 'model.layers.1.mlp.experts.0.up_proj.weight' is "
               r"\(40, 72\) float8 dequantized to bfloat16: every expert's must have the same shape and dtype")
    with pytest.raises(CheckpointError, match=message):
        convert_checkpoint(tmp_path / "hf", tmp_path / "dcp")


def test_a_failure_while_writing_leaves_no_destination_and_no_partial_folder(folder, tmp_path, monkeypatch):
    """Conversion writes into a temporary folder renamed at the end: a weight failing midway loses nothing."""
    calls = [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 5:
            raise CheckpointError("the fifth weight failed")
        return dequantize(*args, **kwargs)

    monkeypatch.setattr(hf_format, "dequantize", failing)
    with pytest.raises(CheckpointError, match="the fifth weight failed"):
        convert_checkpoint(folder.path, tmp_path / "dcp")
    assert not (tmp_path / "dcp").exists() and not list(tmp_path.glob(".dcp.partial-*"))


def test_a_weight_block_size_that_is_not_two_positive_integers_is_refused(folder, tmp_path):
    path = tmp_path / "hf"
    shutil.copytree(folder.path, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"weight_block_size \[128\] is not two positive integers"):
        convert_checkpoint(path, tmp_path / "dcp")

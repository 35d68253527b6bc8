"""DeepSeek-V4-Flash's folder as released (titanctl/checkpoint/quantized/fp4_experts.py names the sources):
names without ``model.``; attention and shared-expert projections FP8 E4M3 beside a UE8M0 ``.scale`` per block
of ``quantization_config.weight_block_size``; routed experts packed FP4 E2M1 (int8, two a byte) beside a UE8M0
``.scale`` per row and 32 values; ``expert_dtype: fp4`` at config.json's top level. ``convert`` and
``checkpoint.initial_load_path`` read it dequantized exactly (each tensor equal to transformers' own
``Fp8Dequantize``), and the model it fills gives the logits of transformers' model on those weights.

The folder is written here, at tiny shapes, from a transformers ``DeepseekV4ForCausalLM`` quantized by an
independent reference (powers-of-two scales, round to nearest); its blocks are 8 x 16 (the release's are
128 x 128; the code reads the declared size) so that every matrix has several.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.unit.checkpoint.test_checkpoint_trust import cli
from tests.unit.hf_reference import IDS, args_of, unit_scale_
from tests.unit.models.families import REFERENCES
from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint, open_checkpoint
from titanctl.checkpoint.hf.names import from_hf_state_dict
from titanctl.checkpoint.run.load_into_model import load_source_into
from titanctl.models.deepseek_v4.hf import PUBLISHED_TOP_NAMES
from titanctl.models.registry import build_model

REFERENCE = next(r for r in REFERENCES if r.family == "deepseek_v4")
PUBLISHED_TOP_NAMES_BACK = {published: saved for saved, published in PUBLISHED_TOP_NAMES.items()}
BLOCK = (8, 16)
FP8, E8M0, FP8_MAX = torch.float8_e4m3fn, torch.float8_e8m0fnu, 448.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
BF16_PROJECTIONS = ("compressor.wkv.weight", "compressor.wgate.weight", "indexer.weights_proj.weight")


def power_of_two_scale(amax: torch.Tensor, largest: float) -> torch.Tensor:
    """UE8M0: the smallest power of two that brings the block's largest |w| within the format's largest."""
    return torch.exp2(torch.ceil(torch.log2((amax / largest).clamp(min=2.0**-100))))


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    blocks = w.reshape(rows // BLOCK[0], BLOCK[0], cols // BLOCK[1], BLOCK[1])
    scale = power_of_two_scale(blocks.abs().amax(dim=(1, 3)), FP8_MAX)  # (rows / 8, cols / 16)
    q = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(FP8)
    return q, scale.to(E8M0)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    groups = w.reshape(rows, cols // 32, 32)
    scale = power_of_two_scale(groups.abs().amax(dim=-1), 6.0)  # (rows, cols / 32)
    scaled = (groups / scale[..., None]).reshape(rows, cols)
    codes = (scaled.abs()[..., None] - E2M1).abs().argmin(-1) | ((scaled < 0).long() << 3)  # nearest, sign bit 3
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)  # low nibble: even column
    return packed, scale.to(E8M0)


def released_kind(name: str) -> str:
    if ".ffn.experts." in name:
        return "fp4"
    if name.startswith("layers.") and name.endswith(".weight") and (".attn.w" in name or ".shared_experts." in name) \
            and not name.endswith(BF16_PROJECTIONS):
        return "fp8"
    return "plain"


class Release:
    def __init__(self, path: Path, theirs, dequantized: dict[str, torch.Tensor]) -> None:
        self.path, self.theirs, self.dequantized = path, theirs, dequantized  # dequantized: save_pretrained's names


def write_release(path: Path, theirs, saved: Path) -> Release:
    """``theirs`` (saved to ``saved``) as the release stores it; with each tensor as transformers dequantizes it."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    reference = Fp8Dequantize(None)
    tensors, dequantized = {}, {}
    by_published = {PUBLISHED_TOP_NAMES.get(k, k.removeprefix("model.")): k
                    for k in load_file(saved / "model.safetensors")}
    state = load_file(saved / "model.safetensors")
    for name, saved_name in by_published.items():
        w = state[saved_name]
        kind = released_kind(name)
        if kind == "plain":
            keep = w if not w.is_floating_point() or name.endswith(".gate.bias") else w.to(torch.bfloat16)
            tensors[name] = dequantized[saved_name] = keep.contiguous()
            continue
        q, scale = (quantize_fp4 if kind == "fp4" else quantize_fp8)(w.float())
        tensors[name], tensors[name.removesuffix(".weight") + ".scale"] = q, scale
        dequantized[saved_name] = reference._dequantize_one(q, scale, output_dtype=torch.float32)
    # The release's prediction depth (mtp.0.*: a block as layer 2's, sliding and score-routed as the release's,
    # and its own projections, norms and head), as stored; dequantized as model.layers.3.*, save_pretrained's name.
    mtp = {"mtp.0." + k.removeprefix("layers.2."): v.clone() for k, v in tensors.items() if k.startswith("layers.2.")}
    dequantized.update({"model.layers.3." + k.removeprefix("model.layers.2."): v.clone()
                        for k, v in dequantized.items() if k.startswith("model.layers.2.")})
    gen = torch.Generator().manual_seed(2)
    for leaf in ("e_proj", "h_proj"):
        q, scale = quantize_fp8(torch.randn(32, 32, generator=gen) / 32**0.5)
        mtp.update({f"mtp.0.{leaf}.weight": q, f"mtp.0.{leaf}.scale": scale})
        dequantized[f"model.layers.3.{leaf}.weight"] = reference._dequantize_one(q, scale, output_dtype=torch.float32)
    own = {f"{leaf}.weight": (1 + 0.1 * torch.randn(32, generator=gen)).to(torch.bfloat16)
           for leaf in ("enorm", "hnorm", "norm")}
    own.update({f"hc_head_{leaf}": (tensors[f"hc_head_{leaf}"].float() * 1.5).to(tensors[f"hc_head_{leaf}"].dtype)
                for leaf in ("fn", "base", "scale")})
    mtp.update({"mtp.0." + k: v for k, v in own.items()})
    dequantized.update({"model.layers.3." + k: v.clone() for k, v in own.items()})
    path.mkdir()
    save_file({k: v for k, v in tensors.items() if not k.startswith("layers.2.")},
              str(path / "model-00001-of-00002.safetensors"))
    save_file({**{k: v for k, v in tensors.items() if k.startswith("layers.2.")}, **mtp},
              str(path / "model-00002-of-00002.safetensors"))
    tensors.update(mtp)
    weight_map = {k: f"model-0000{1 + (k.startswith(('layers.2.', 'mtp.')))}-of-00002.safetensors" for k in tensors}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((saved / "config.json").read_text())
    config["expert_dtype"] = "fp4"
    config["num_nextn_predict_layers"] = 1
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "scale_fmt": "ue8m0", "weight_block_size": list(BLOCK)}
    (path / "config.json").write_text(json.dumps(config))
    return Release(path, theirs, dequantized)


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Release:
    import transformers

    config = REFERENCE.config()
    config.moe_intermediate_size = 32  # FP4 scales cover 32 input values: the experts' down projection's too
    torch.manual_seed(0)
    theirs = transformers.DeepseekV4ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    unit_scale_(theirs, gen)
    REFERENCE.after_init(theirs, gen)
    root = tmp_path_factory.mktemp("v4release")
    theirs.save_pretrained(root / "saved")
    return write_release(root / "release", theirs, root / "saved")


@pytest.fixture(scope="module")
def dcp(release, tmp_path_factory) -> Path:
    """The release converted to DCP (bf16, as ``titanctl convert`` does by default)."""
    out = tmp_path_factory.mktemp("v4release_dcp") / "dcp"
    convert_checkpoint(release.path, out, dst_format="dcp")
    return out


def stored(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for path in sorted(folder.glob("*.safetensors")) for k, v in load_file(path).items()}


def test_the_folder_holds_the_released_layout(release):
    dtypes = {}
    for path in release.path.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            dtypes.update({key: f.get_slice(key).get_dtype() for key in f.keys()})
    assert dtypes["layers.0.attn.wq_a.weight"] == "F8_E4M3" and dtypes["layers.0.attn.wq_a.scale"] == "F8_E8M0"
    assert dtypes["layers.1.ffn.experts.3.w2.weight"] == "I8" and dtypes["layers.1.ffn.experts.3.w2.scale"] == "F8_E8M0"
    assert dtypes["layers.0.ffn.shared_experts.w1.weight"] == "F8_E4M3"
    assert dtypes["layers.0.attn.compressor.wkv.weight"] == "BF16" and dtypes["embed.weight"] == "BF16"
    assert not any(key.endswith("_scale_inv") or key.startswith("model.") for key in dtypes)
    assert dtypes["mtp.0.ffn.experts.1.w3.weight"] == "I8" and dtypes["mtp.0.e_proj.scale"] == "F8_E8M0"


def test_convert_dequantizes_every_tensor_as_transformers_does(release, tmp_path, capsys):
    """``titanctl convert`` to DCP (bfloat16, the default): each tensor is transformers' dequantization cast
    to bfloat16, and the FP8 and FP4 ones are exact there (a few significant bits times a power of two)."""
    dtype = "bfloat16"
    proc = cli(["convert", release.path, tmp_path / "dcp", "--to", "dcp"], capsys)
    assert proc.returncode in (0, None), proc.stderr
    ours, args = load_checkpoint(tmp_path / "dcp")
    want = from_hf_state_dict(release.dequantized, args)  # quantized ones float32, the rest as stored
    quantized = {k for k, v in want.items() if v.dtype == torch.float32 and not k.endswith("expert_bias")}
    # The 24 FP8 projections and the depth's 10 (its block's 8, e_proj, h_proj), and each block's two expert stacks
    assert len(quantized) == 24 + 10 + 4 * 2
    assert ours.keys() == want.keys()
    for name, tensor in want.items():
        expected = tensor.to(getattr(torch, dtype)) if name in quantized else tensor
        assert ours[name].dtype == expected.dtype and torch.equal(ours[name], expected), name
    assert all(torch.equal(ours[k].float(), want[k]) for k in quantized)
    notes = " ".join(proc.stdout.split())
    assert f"34 FP8 weights dequantized to {dtype} with their 8x16 block scales (weight_scale_inv, or " \
           "DeepSeek-V4's .scale)" in notes, proc.stdout
    assert f"48 FP4 expert weights (int8, two E2M1 values a byte) dequantized exactly to {dtype} with their " \
           "scales (one per 32 values)" in notes, proc.stdout


def test_a_run_starting_from_the_folder_gives_the_logits_of_transformers_loading_it(release):
    """checkpoint.initial_load_path's path (a fresh model filled from the folder, fp32) against transformers'
    own loading of the same folder (its FP8 quantizer, dequantize=True): 0 missing keys, equal logits."""
    import transformers

    quantization = transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=BLOCK, scale_fmt="ue8m0",
                                                     expert_dtype="fp4")
    theirs, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        release.path, dtype=torch.float32, quantization_config=quantization, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.device("meta"):
        model = build_model(args_of(release.theirs))
    model.to_empty(device="cpu").init_buffers("cpu")
    with open_checkpoint(release.path) as source:
        source.dequantize_to = torch.float32
        load_source_into(model, source)
    with torch.no_grad():
        assert torch.equal(model.eval()(IDS), theirs.float().eval()(IDS).logits)


def _model_from(folder: Path, args):
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu").init_buffers("cpu")
    with open_checkpoint(folder) as source:
        source.dequantize_to = torch.float32
        load_source_into(model, source)
    return model.eval()


def test_the_folders_depth_gives_the_logits_of_the_same_depth_under_save_pretrained_names(release, tmp_path):
    """model.mtp_layers = 1: mtp.0.* fill depth 0 (its block layers.3), dequantized as the main layers are; the
    model's logits and the depth's equal those of the model read from save_pretrained's names (model.layers.3.*)
    of the same tensors dequantized by transformers."""
    saved = tmp_path / "saved"
    saved.mkdir()
    save_file({k: v.contiguous() for k, v in release.dequantized.items()}, str(saved / "model.safetensors"))
    config = json.loads((release.path / "config.json").read_text())
    del config["quantization_config"], config["expert_dtype"]
    (saved / "config.json").write_text(json.dumps(config))
    args = args_of(release.theirs).replace(mtp_layers=1)
    with torch.no_grad():
        (main, (depth,)), (main_saved, (depth_saved,)) = (_model_from(folder, args)(IDS, mtp=True)
                                                          for folder in (release.path, saved))
    assert torch.equal(main, main_saved) and torch.equal(depth, depth_saved)
    assert not torch.equal(depth, main)


def test_a_model_without_depths_carries_the_folders_and_writes_them_back(release, tmp_path, capsys):
    """model.mtp_layers = 0 (here the folder's config.json declares none): mtp.* carried as stored, in no model
    tensor, and the export writes every tensor of the release back bit for bit."""
    folder = tmp_path / "no_depths"
    folder.mkdir()
    for path in release.path.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    config = json.loads((release.path / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    proc = cli(["convert", folder, tmp_path / "dcp", "--to", "dcp"], capsys)
    assert proc.returncode in (0, None), proc.stderr
    assert "tensors of the published folder carried unchanged" in " ".join(proc.stdout.split()), proc.stdout
    ours, args = load_checkpoint(tmp_path / "dcp")
    assert args.mtp_layers == 0 and not any(k.startswith("mtp.") or k.startswith("layers.3.") for k in ours)
    proc = cli(["convert", tmp_path / "dcp", tmp_path / "back", "--to", "hf"], capsys)
    assert proc.returncode in (0, None), proc.stderr
    source, back = stored(release.path), stored(tmp_path / "back")
    assert back.keys() == source.keys()
    assert all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in source.items())


def _rewrite(release: Release, tmp_path: Path, change) -> Path:
    folder = tmp_path / "broken"
    folder.mkdir()
    tensors = stored(release.path)
    config = json.loads((release.path / "config.json").read_text())
    change(tensors, config)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


SCALE = "layers.1.ffn.experts.2.w1.scale"
BROKEN = {
    "undeclared": (lambda t, c: c.pop("expert_dtype"),
                   r"int8 beside block scales \(packed FP4\), but config.json does not declare expert_dtype 'fp4'"),
    "scale shape": (lambda t, c: t.update({SCALE: t[SCALE][:-1].contiguous()}),
                    r"needs \(32, 1\) \(one scale per row and 32 values\)"),
    "NaN scale": (lambda t, c: t.update({SCALE: torch.full(t[SCALE].shape, 255, dtype=torch.uint8).view(E8M0)}),
                  r"holds nan at block \(0, 0\): a block scale must be finite"),
}


@pytest.mark.parametrize("how", list(BROKEN))
def test_a_broken_release_is_refused_in_one_line_before_anything_is_written(release, tmp_path, capsys, how):
    change, message = BROKEN[how]
    folder = _rewrite(release, tmp_path, change)
    proc = cli(["convert", folder, tmp_path / "out", "--to", "dcp"], capsys)
    assert proc.returncode == 2 and re.search(message, " ".join(proc.stderr.split())), proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_hf_to_dcp_to_hf_gives_the_release_back_bit_for_bit(release, dcp, tmp_path, capsys):
    """The UE8M0 scales ride through DCP as stored; the export divides the dequantized weights by them again:
    every tensor of the release (FP8, FP4 int8, scales, the rest) bit for bit, and config.json's
    quantization keys back."""
    proc = cli(["convert", dcp, tmp_path / "back", "--to", "hf"], capsys)
    assert proc.returncode in (0, None), proc.stderr
    source, back = stored(release.path), stored(tmp_path / "back")
    assert back.keys() == source.keys() and any(k.startswith("mtp.0.") for k in back)
    ours, args = load_checkpoint(dcp)  # the depth is the model's (mtp_layers 1, from config.json), not carried
    assert args.mtp_layers == 1 and "mtp.0.e_proj.weight" in ours and "layers.3.self_attn.q_a_proj.weight" in ours
    for name, tensor in source.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name].view(torch.uint8),
                                                                tensor.view(torch.uint8)), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    ours = json.loads((release.path / "config.json").read_text())
    assert config["quantization_config"] == ours["quantization_config"] and config["expert_dtype"] == "fp4"
    assert config["num_nextn_predict_layers"] == 1
    files = [sorted(p.name for p in folder.glob("*.safetensors")) for folder in (tmp_path / "back", release.path)]
    assert files[0] == files[1] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index, theirs = (json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
                     for folder in (tmp_path / "back", release.path))
    assert index == theirs


def test_trained_weights_are_written_as_the_nearest_value_at_the_carried_scale(release):
    """After training (each weight moved by 1% here), the export writes each value as the nearest one its
    format holds at its block's carried scale (a saturated value as the largest: 448 or 6 times it), counted."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from titanctl.checkpoint.quantized.requantize import against

    tensors = stored(release.path)
    fp8_values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    fp8_values = fp8_values[fp8_values.isfinite()]
    fp4_values = torch.cat([E2M1, -E2M1])
    gen = torch.Generator().manual_seed(3)
    checked = {"fp8": 0, "fp4": 0}
    for name in ("layers.0.attn.wq_a.weight", "layers.2.ffn.shared_experts.w2.weight",
                 "layers.1.ffn.experts.0.w1.weight", "layers.2.ffn.experts.3.w2.weight"):
        scale = tensors[name.removesuffix(".weight") + ".scale"]
        weight = Fp8Dequantize(None)._dequantize_one(tensors[name], scale, output_dtype=torch.float32)
        trained = (weight * (1 + 0.01 * torch.randn(weight.shape, generator=gen))).to(torch.bfloat16)
        trained.view(-1)[0] = 1e4  # far beyond its block's range: saturates
        written = against(trained, scale, BLOCK)
        back = Fp8Dequantize(None)._dequantize_one(written.tensor, scale, output_dtype=torch.float32)
        kind = "fp4" if written.tensor.dtype == torch.int8 else "fp8"
        spread = (scale.float().repeat_interleave(32, -1) if kind == "fp4" else
                  scale.float().repeat_interleave(BLOCK[0], -2).repeat_interleave(BLOCK[1], -1))
        grid = (fp4_values if kind == "fp4" else fp8_values)[None, :] * spread.reshape(-1, 1)
        nearest = (grid - trained.float().reshape(-1, 1)).abs().min(dim=1).values
        assert torch.equal((back - trained.float()).abs().reshape(-1), nearest), name
        largest = 6.0 if kind == "fp4" else FP8_MAX
        assert written.saturated == int((trained.float() / spread).abs().gt(largest).sum()) >= 1  # 1% beyond, too
        assert back.view(-1)[0] == largest * spread.view(-1)[0]
        checked[kind] += 1
    assert checked == {"fp8": 2, "fp4": 2}


def test_text_only_writes_the_model_alone_unquantized(release, dcp, tmp_path, capsys):
    """--text-only: the model's weights as the checkpoint holds them (bf16; its prediction depth under the
    folder's mtp.0.*), no scales, and a config.json without the release's quantization keys: a folder
    transformers reads as unquantized."""
    proc = cli(["convert", dcp, tmp_path / "plain", "--to", "hf", "--text-only"], capsys)
    assert proc.returncode in (0, None), proc.stderr
    left = sum(k.endswith(".scale") for k in stored(release.path))  # the scales: the depth is the model's
    assert f"--text-only: {left} carried tensors left out" in " ".join(proc.stdout.split()), proc.stdout
    written = stored(tmp_path / "plain")
    assert not any(k.endswith(".scale") for k in written) and "mtp.0.e_proj.weight" in written
    assert {v.dtype for v in written.values() if v.is_floating_point()} <= {torch.bfloat16, torch.float32}
    ours, args = load_checkpoint(dcp)
    assert all(torch.equal(v, ours[k]) for k, v in from_hf_state_dict(
        {PUBLISHED_TOP_NAMES_BACK.get(k, "model." + k.replace("mtp.0.", "layers.3.", 1)
                                      if k.startswith(("layers.", "mtp.")) else k): v
         for k, v in written.items()}, args).items() if k in ours)
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "quantization_config" not in config and "expert_dtype" not in config

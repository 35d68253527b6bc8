"""Float8 linears (torchao) in one process: which linears convert and why not, the checks that
refuse impossible settings, real float8 numerics on CPU, the TP plan's styles, a quiet import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from titanctl.config.job_config import Float8
from titanctl.config.recipe import load_config
from titanctl.errors import ConfigError, ParallelError
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.decoder import Transformer
from titanctl.models.common.tp_plan import DECODER_TP_PLAN, block_plan, sharded_linear_dims
from titanctl.parallel.converters import float8
from titanctl.parallel.layouts.build import check_layout
from titanctl.parallel.layouts.dims import ParallelDims
from titanctl.parallel.layouts.weight_init import initialize_weights

CPU = torch.device("cpu")
# head_dim 16, 2 kv heads: wk/wv are 64 -> 32 (multiples of 16); ffn hidden 192.
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=32)


def meta_model(args: ModelArgs = ARGS) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


def test_default_filter_keeps_the_output_layer():
    plan = float8.plan_conversion(meta_model(), Float8(), tp=1)
    assert plan.kept == {"output": "float8.filter_fqns"}
    assert len(plan.converted) == 7 * ARGS.n_layers
    assert plan.describe() == "float8: 14 linear layers in float8; kept in high precision: output (float8.filter_fqns)"


def test_linears_whose_dims_are_not_multiples_of_16_stay_high_precision():
    args = ARGS.replace(dim=72, n_heads=4, n_kv_heads=1, vocab_size=130)  # head_dim 18: wk/wv are 72 -> 18
    plan = float8.plan_conversion(meta_model(args), Float8(filter_fqns=[]), tp=1)
    assert plan.kept["layers.0.attention.wk"] == "dims 18x72 are not multiples of 16"
    assert plan.kept["output"] == "dims 130x72 are not multiples of 16"
    assert "layers.1.attention.wv" in plan.kept and "layers.0.attention.wq" in plan.kept  # 72x72
    assert "skipped" not in plan.describe() and "layers.0.attention.wk (dims 18x72" in plan.describe()


def test_dims_are_checked_per_tensor_parallel_shard():
    # wk: 64 -> 32 out features, split colwise over tp 4: 8 per shard. wo: in features 64 / 4 = 16.
    plan, args = DECODER_TP_PLAN, meta_model().args
    assert sharded_linear_dims("layers.0.attention.wk", 4, plan, args) == (4, 1)
    assert sharded_linear_dims("layers.3.feed_forward.w2", 4, plan, args) == (1, 4)
    assert sharded_linear_dims("output", 4, plan, args) == (4, 1)
    plan = float8.plan_conversion(meta_model(), Float8(), tp=4)
    assert plan.kept["layers.0.attention.wk"] == "dims 8x64 per tensor-parallel shard are not multiples of 16"
    assert "layers.0.attention.wo" in plan.converted


@pytest.mark.parametrize(
    "patterns, kept",
    [
        (["attention.wk"], {"layers.0.attention.wk", "layers.1.attention.wk"}),
        (["layers.1"], {f"layers.1.{n}" for n in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                                                  "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}),
        (["output", "feed_forward.w2"], {"output", "layers.0.feed_forward.w2", "layers.1.feed_forward.w2"}),
    ],
)
def test_filter_fqns_match_whole_dotted_parts(patterns, kept):
    plan = float8.plan_conversion(meta_model(), Float8(filter_fqns=patterns), tp=1)
    assert set(plan.kept) == kept


def test_a_filter_entry_that_names_nothing_is_an_error():
    with pytest.raises(ConfigError, match="float8.filter_fqns entry 'outptu' names no linear layer"):
        float8.plan_conversion(meta_model(), Float8(filter_fqns=["outptu"]), tp=1)
    with pytest.raises(ConfigError, match="'w'"):  # a part of a name, not a substring
        float8.plan_conversion(meta_model(), Float8(filter_fqns=["w"]), tp=1)


@pytest.mark.parametrize(
    "overrides, world, error, message",
    [
        (["--float8.enable_fsdp_float8_all_gather"], 2, ConfigError,
         "float8.enable_fsdp_float8_all_gather = true needs float8.enable_float8_linear = true"),
        (["--float8.enable_float8_linear", "--float8.enable_fsdp_float8_all_gather",
          "--parallelism.tensor_parallel_degree", "2"], 2, ParallelError,
         "float8.enable_fsdp_float8_all_gather = true needs FSDP"),
        (["--float8.enable_float8_linear", "--float8.precompute_float8_dynamic_scale_for_fsdp"], 2, ConfigError,
         "needs float8.enable_fsdp_float8_all_gather = true"),
        (["--float8.enable_float8_linear", "--float8.enable_fsdp_float8_all_gather", "--float8.recipe_name",
          "rowwise"], 2, ConfigError, "needs float8.recipe_name = 'tensorwise'"),
    ],
)
def test_impossible_float8_settings_fail_before_building(overrides, world, error, message):
    cfg = load_config(None, ["--training.seq_len", "32", *overrides])
    dims = ParallelDims.from_config(cfg.parallelism, world)
    with pytest.raises(error) as err:
        check_layout(cfg, dims, ARGS)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_float8_on_an_unsupported_device_type_is_refused():
    with pytest.raises(ParallelError, match="runs on CUDA or CPU, not on mps"):
        float8.convert_to_float8(meta_model(), Float8(), tp=1, device=torch.device("mps"))


def converted_pair() -> tuple[Transformer, Transformer]:
    plain = Transformer(ARGS)
    initialize_weights(plain, seed=0)
    f8 = Transformer(ARGS)
    f8.load_state_dict(plain.state_dict())
    float8.convert_to_float8(f8, Float8(), tp=1, device=CPU)
    return plain, f8


def test_float8_model_has_the_same_weights_under_the_same_names():
    plain, f8 = converted_pair()
    f8_linear = float8.torchao_float8().float8_linear.Float8Linear
    assert sum(isinstance(m, f8_linear) for m in f8.modules()) == 14
    assert not isinstance(f8.output, f8_linear)
    state, ref = f8.state_dict(), plain.state_dict()
    assert state.keys() == ref.keys()
    for key, tensor in ref.items():
        assert type(state[key]) is torch.Tensor and state[key].dtype == tensor.dtype and torch.equal(state[key], tensor)


def test_the_recipe_name_picks_torchaos_scaling():
    """rowwise: one scale per row of every operand (torchao's axiswise casts), power-of-2 scales;
    tensorwise (the default): one per tensor. A rowwise linear's output differs from a tensorwise one's."""
    plain, tensorwise = converted_pair()
    rowwise = Transformer(ARGS)
    rowwise.load_state_dict(plain.state_dict())
    float8.convert_to_float8(rowwise, Float8(recipe_name="rowwise"), tp=1, device=CPU)
    granularity = float8.torchao_float8().config.ScalingGranularity
    for model, expected in ((tensorwise, granularity.TENSORWISE), (rowwise, granularity.AXISWISE)):
        config = model.layers["0"].attention.wq.config
        assert config.cast_config_input.scaling_granularity is expected
        assert config.cast_config_weight.scaling_granularity is expected
    assert rowwise.layers["0"].attention.wq.config.round_scales_to_power_of_2
    x = torch.randn(64, ARGS.dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.equal(rowwise.layers["0"].attention.wq(x), tensorwise.layers["0"].attention.wq(x))
    assert float8.communicates_float8(Float8(enable_float8_linear=True))
    assert not float8.communicates_float8(Float8(enable_float8_linear=True, recipe_name="rowwise"))


@pytest.mark.slow
def test_float8_numerics_are_float8s_on_cpu():
    """Not a no-op: a float8 linear's output moves by about float8's rounding (e4m3: 3 mantissa
    bits, a few %), ten times bf16's; the logits move too; gradients flow through every linear."""
    plain, f8 = converted_pair()
    x = torch.randn(64, ARGS.dim, generator=torch.Generator().manual_seed(0))
    ref, out = plain.layers["0"].attention.wq(x), f8.layers["0"].attention.wq(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = plain.layers["0"].attention.wq(x).float()
    f8_error = ((out - ref).abs().mean() / ref.abs().mean()).item()
    bf16_error = ((bf16 - ref).abs().mean() / ref.abs().mean()).item()
    assert 0.01 < f8_error < 0.1 and f8_error > 5 * bf16_error, (f8_error, bf16_error)

    tokens = torch.randint(0, ARGS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    ref_logits, logits = plain(tokens), f8(tokens)
    assert 1e-5 < ((logits - ref_logits).abs().mean() / ref_logits.abs().mean()).item() < 1e-2
    logits.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in f8.parameters())


def test_emulation_is_announced_without_float8_hardware(monkeypatch):
    note = float8.emulation_note(CPU)
    assert note.startswith("float8 is emulated: cpu has no float8 matmul hardware")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert float8.emulation_note(torch.device("cuda", 0)) is None  # H100: real float8
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(float8, "_scaled_mm_runs", lambda device_type: False)
    assert "torchao's emulation" in float8.emulation_note(torch.device("cuda", 0))  # A100


def test_block_plan_uses_float8_styles_only_where_the_linears_are_float8():
    styles = float8.float8_tp_styles()
    all_linears = ["attention.wq", "attention.wk", "attention.wv", "attention.wo",
                   "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    names = {k: type(v).__name__ for k, v in block_plan(styles, all_linears).items()}
    assert names["attention"] == names["feed_forward"] == "PrepareFloat8ModuleInput"
    assert names["attention.wq"] == "Float8ColwiseParallel" and names["feed_forward.w2"] == "Float8RowwiseParallel"
    # wk kept in high precision: it gets the plain style, and the gather feeding it stays plain.
    names = {k: type(v).__name__ for k, v in block_plan(styles, [n for n in all_linears if n != "attention.wk"]).items()}
    assert names["attention.wk"] == "ColwiseParallel" and names["attention"] == "PrepareModuleInput"
    assert names["attention.wq"] == "Float8ColwiseParallel" and names["feed_forward"] == "PrepareFloat8ModuleInput"
    dense = {type(v).__name__ for k, v in block_plan().items() if not k.startswith("moe")}
    assert dense == {"SequenceParallel", "PrepareModuleInput", "ColwiseParallel", "RowwiseParallel"}


def test_torchao_is_imported_lazily_and_quietly():
    probe = (
        "import sys\n"
        "import titanctl.parallel.layouts.build, titanctl.train.trainer\n"
        "assert 'torchao' not in sys.modules, 'torchao imported without float8'\n"
        "from titanctl.parallel.converters.float8 import torchao_float8\n"
        "torchao_float8()\n"
        "assert 'torchao.float8' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Failed to load" not in proc.stderr and "Enum subclass" not in proc.stderr, proc.stderr

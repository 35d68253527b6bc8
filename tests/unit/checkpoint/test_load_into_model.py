"""A checkpoint of any format loads straight into a model: bit-identical to loading the DCP it
was converted from. (Sharded models: tests/distributed/test_load_into_model.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titanctl.checkpoint.convert import convert_checkpoint, open_checkpoint
from titanctl.checkpoint.run.load_into_model import load_source_into
from titanctl.errors import CheckpointError
from titanctl.models.common.decoder import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def empty_model(args) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    return model


def dcp_loaded(args, folder) -> Transformer:
    """The reference: DCP fills the model's own state dict, as a model-only initial load does."""
    model = empty_model(args)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return model


@pytest.fixture(scope="module")
def exports(trained_debug, tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    for fmt in ("hf", "torchtitan", "meta", "torchtune"):
        convert_checkpoint(trained_debug["folder"], root / fmt, dst_format=fmt)
    return root


@pytest.mark.parametrize("fmt", ["hf", "torchtitan", "meta", "torchtune", "dcp"])
def test_every_format_loads_bit_identically_to_dcp(trained_debug, exports, fmt):
    args = trained_debug["args"]
    want = dcp_loaded(args, trained_debug["folder"]).state_dict()
    folder = trained_debug["folder"] if fmt == "dcp" else exports / fmt
    model = empty_model(args)
    with open_checkpoint(folder) as source:
        report = load_source_into(model, source)
    assert sorted(report.loaded) == sorted(want) and report.not_in_model == []
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want[name]), name


def test_a_pipeline_stage_reads_only_its_own_layers(trained_debug, exports):
    model = empty_model(trained_debug["args"])
    del model.layers["1"]  # what a first pipeline stage keeps of a 2-layer model (and no output)
    model.norm, model.output = None, None
    with open_checkpoint(exports / "hf") as source:
        read = []
        load = source.load
        source.load = lambda name: (read.append(name), load(name))[1]
        report = load_source_into(model, source)
    assert sorted(read) == sorted(report.loaded) == sorted(model.state_dict())
    assert "layers.1.attention.wq.weight" in report.not_in_model and "output.weight" in report.not_in_model
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained_debug["state"][name]), name


def test_a_model_that_does_not_fit_is_refused_before_any_copy(trained_debug, exports):
    other = empty_model(trained_debug["args"].replace(n_layers=3))
    with torch.no_grad():
        for param in other.parameters():
            param.fill_(0.5)
    with open_checkpoint(exports / "torchtitan") as source, pytest.raises(
        CheckpointError, match="has no tensor 'layers.2.attention.wq.weight', which the model has"
    ):
        load_source_into(other, source)
    wide = empty_model(trained_debug["args"].replace(n_kv_heads=8))
    with open_checkpoint(exports / "hf") as source, pytest.raises(
        CheckpointError, match=r"'model.layers.0.self_attn.k_proj.weight' .* has shape \(64, 256\), the model's "
    ):
        load_source_into(wide, source)
    assert all(bool((param == 0.5).all()) for param in other.parameters())  # nothing was copied


def test_bf16_model_takes_the_weights_cast(trained_debug, exports):
    model = empty_model(trained_debug["args"]).to(torch.bfloat16)
    with open_checkpoint(exports / "torchtitan") as source:
        load_source_into(model, source)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained_debug["state"][name].to(torch.bfloat16)), name

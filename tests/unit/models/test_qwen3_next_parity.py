"""Qwen3-Next's own mechanisms against transformers' Qwen3NextForCausalLM (its logits, round trips and size are
the conformance suite's): every parameter's gradient, the fused Gated DeltaNet projections split by key-head
groups as tensor parallelism splits them, packed documents equal to each run alone, decoding through the
state cache, and the layer schedules of config.json that titanctl does not build refused in one line.

Precision: fp32, as the other MoE families' parity (the grouped expert GEMMs take no fp64, and transformers'
gated delta rule computes in fp32 whatever the model's dtype).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel

from tests.unit.hf_reference import IDS, args_of, titanctl_model_of
from tests.unit.models.families import REFERENCES, qwen3_next_config
from tests.unit.models.test_qwen3_5_parity import packed_documents
from titanctl.checkpoint.hf.names import args_from_hf_config, from_hf_state_dict
from titanctl.errors import CheckpointError
from titanctl.models.common.document_mask import dense_document_mask
from titanctl.models.registry import spec_of


@pytest.fixture(scope="module")
def theirs():
    return next(r for r in REFERENCES if r.case == "qwen3_next").build()


def test_gradients_equal_transformers(theirs):
    """Every parameter's gradient of one loss (the dense first layer's FFN, the routers, the shared expert's
    gate, the fused projections, A_log and the conv included): within 2e-4 of the largest of that parameter's
    (measured: 9.1e-5, the first layer's gated norm, whose gradient passes three Gated DeltaNet layers that
    each amplify fp32 rounding)."""
    ours = titanctl_model_of(theirs)
    labels = IDS.roll(-1, dims=1).flatten()
    F.cross_entropy(theirs(IDS).logits.flatten(0, 1), labels).backward()
    F.cross_entropy(ours(IDS).flatten(0, 1), labels).backward()
    expected = from_hf_state_dict({n: p.grad for n, p in theirs.named_parameters()}, args_of(theirs))
    theirs.zero_grad()
    names = {n for n, _ in ours.named_parameters()}
    assert {"layers.0.feed_forward.w1.weight", "layers.1.moe.shared_gate.weight",
            "layers.0.attention.wqkvz.weight", "layers.0.attention.wba.weight"} <= names
    for name, p in ours.named_parameters():
        scale = expected[name].abs().max().item()
        assert scale > 0, name
        assert (p.grad - expected[name]).abs().max().item() <= 2e-4 * scale, name


@torch.no_grad()
def test_fused_projections_split_by_key_head_groups(theirs):
    """in_proj_qkvz / in_proj_ba load unchanged (titanctl stores them as published), and the first half of
    their rows, what tensor-parallel rank 0 of 2 holds, projects exactly key head 0's group: its q, k and
    value heads (the conv's input), their z, b and a."""
    ours = titanctl_model_of(theirs)
    layer = ours.layers["0"].attention
    hf = theirs.model.layers[0].linear_attn
    assert torch.equal(layer.wqkvz.weight, hf.in_proj_qkvz.weight) and torch.equal(layer.wba.weight, hf.in_proj_ba.weight)
    x = torch.randn(2, 5, ours.args.dim)
    whole = layer.project(x)
    for name in ("wqkvz", "wba"):
        linear = getattr(layer, name)
        linear.weight = torch.nn.Parameter(linear.weight.chunk(2)[0])
    for full, half in zip(whole, layer.project(x)):
        assert torch.equal(half, full.chunk(2, dim=-1)[0])
    block = spec_of(ours.args).tp_plan.block(ours.args)
    assert isinstance(block["attention.wqkvz"], ColwiseParallel) and isinstance(block["attention.wba"], ColwiseParallel)
    assert "attention.wqkv" not in block


@torch.no_grad()
def test_packed_documents_and_decoding(theirs):
    """A packed block-causal batch equals its documents run one by one (against a leak of > 0.1); prefill then
    one token at a time through the state cache equals the full forward."""
    model = titanctl_model_of(theirs)
    doc_ids = packed_documents()
    starts = torch.cat([torch.ones(2, 1, dtype=torch.bool), doc_ids[:, 1:] != doc_ids[:, :-1]], dim=1)
    index = torch.arange(48).expand(2, 48)
    positions = index - torch.cummax(torch.where(starts, index, 0), dim=1).values
    packed = model(IDS, attn_mask=dense_document_mask(doc_ids), positions=positions)
    for row in range(2):
        for doc in doc_ids[row].unique():
            where = (doc_ids[row] == doc).nonzero().flatten()
            assert (packed[row, where] - model(IDS[row : row + 1, where])[0]).abs().max() < 5e-4, (row, doc)
    assert (packed - model(IDS)).abs().max() > 0.1
    ids = IDS[:1, :14]
    full = model(ids)
    model.setup_kv_cache(16)
    prefill = model(ids[:, :9], input_pos=torch.arange(9))
    steps = [model(ids[:, t : t + 1], input_pos=torch.tensor([t])) for t in range(9, 14)]
    model.clear_kv_cache()
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, rtol=0, atol=5e-4)


@pytest.mark.parametrize("changes, says", [
    (dict(decoder_sparse_step=2), "decoder_sparse_step 2 (MoE in every 2th layer) is not supported"),
    (dict(mlp_only_layers=[1]), "mlp_only_layers [1] must be the first layers"),
    (dict(mlp_only_layers=[0, 1, 2, 3, 4]), "mlp_only_layers [0, 1, 2, 3, 4] must be the first layers (0, 1, ...) "
                                            "of the 4"),
], ids=["sparse-step", "not-first", "beyond-depth"])
def test_schedules_titanctl_does_not_build_are_refused_in_one_line(changes, says):
    with pytest.raises(CheckpointError) as err:
        args_from_hf_config({**qwen3_next_config().to_dict(), **changes}, max_seq_len=64)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_an_all_dense_schedule_reads():
    config = {**qwen3_next_config().to_dict(), "mlp_only_layers": [0, 1, 2, 3], "decoder_sparse_step": 2}
    args = args_from_hf_config(config, max_seq_len=64)
    assert args.family == "qwen3_next" and not any(args.is_moe_layer(i) for i in range(4))


def test_the_releases_prediction_head_is_left_unread_in_one_line(theirs, tmp_path):
    """Qwen/Qwen3-Next-80B-A3B's folder is save_pretrained's names plus its mtp.* tensors, which
    Qwen3NextForCausalLM does not build: they are named in one line, and the model converts."""
    from safetensors.torch import load_file, save_file

    from titanctl.checkpoint.convert import convert_checkpoint

    theirs.save_pretrained(tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    save_file({**weights, "mtp.fc.weight": torch.ones(4, 4), "mtp.norm.weight": torch.ones(4)},
              str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    report = convert_checkpoint(tmp_path / "hf", tmp_path / "dcp", dst_format="dcp")
    assert report.notes == ["2 tensors of the published folder left unread, titanctl does not build them: mtp.* (2, "
                            "the multi-token-prediction head); an export is the model without them "
                            "(Qwen3NextForCausalLM, under the folder's names)"]

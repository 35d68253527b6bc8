"""Qwen3.5's own mechanisms against transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (their logits,
round trips and sizes are the conformance suite's): every parameter's gradient, that partial RoPE and the
zero-centred norms matter, packed documents equal to each document run alone (the Gated DeltaNet's conv
window and state restart at each boundary), decoding through the state cache, and the config.json and
titanctl.json values refused in one line.

MRoPE: transformers builds three position rows (time, height, width) and interleaves their frequencies;
for text the rows are equal, so it is 1-D RoPE, and the logits test (titanctl's 1-D table) checks it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.unit.hf_reference import IDS, args_of, max_logit_delta, titanctl_model_of
from tests.unit.models.families import REFERENCES, qwen3_5_config
from titanctl.checkpoint.hf.names import args_from_hf_config, from_hf_state_dict
from titanctl.checkpoint.trust.model_args import args_from_fields
from titanctl.errors import CheckpointError
from titanctl.models.common.document_mask import block_document_mask, dense_document_mask
from titanctl.models.common.gated_deltanet import document_starts
from titanctl.models.common.span_mask import SpanMask
from titanctl.models.registry import build_model


def reference(case: str):
    return next(r for r in REFERENCES if r.case == case).build()


@pytest.mark.parametrize("case", ["qwen3_5", "qwen3_5_moe"])
def test_gradients_equal_transformers(case):
    """Every parameter's gradient of one loss, the router, the shared expert's gate, A_log and the conv
    included: within 1e-4 of the largest of that parameter's (measured: 1.0e-5 dense, 1.6e-5 MoE)."""
    theirs = reference(case)
    ours = titanctl_model_of(theirs)
    labels = IDS.roll(-1, dims=1).flatten()
    F.cross_entropy(theirs(IDS).logits.flatten(0, 1), labels).backward()
    F.cross_entropy(ours(IDS).flatten(0, 1), labels).backward()
    expected = from_hf_state_dict({n: p.grad for n, p in theirs.named_parameters()}, args_of(theirs))
    names = {n for n, _ in ours.named_parameters()}
    assert any("moe.shared_gate" in n for n in names) == (case == "qwen3_5_moe")
    for name, p in ours.named_parameters():
        scale = expected[name].abs().max().item()
        assert scale > 0, name
        assert (p.grad - expected[name]).abs().max().item() <= 1e-4 * scale, name


@torch.no_grad()
def test_partial_rope_and_zero_centred_norms_matter():
    """The comparison has teeth: RoPE over whole heads, or norms that scale by weight, differ."""
    theirs = reference("qwen3_5")
    args = args_of(theirs)
    assert args.rope_dim == 8 and args.head_dim == 16 and args.norm_offset
    for changed in (args.replace(partial_rope_dim=0), args.replace(norm_offset=False)):
        assert max_logit_delta(titanctl_model_of(theirs, changed, read_as=args), theirs) > 0.1


def packed_documents():
    """Row 0: documents of 20 and 28 tokens; row 1: 9, 1 and 38 (a one-token document, and a boundary
    inside the conv's window of the one before)."""
    doc_ids = torch.zeros(2, 48, dtype=torch.long)
    doc_ids[0, 20:] = 1
    doc_ids[1, 9:] = 1
    doc_ids[1, 10:] = 2
    return doc_ids


@torch.no_grad()
@pytest.mark.parametrize("case, dtype, tol", [("qwen3_5", torch.float64, 1e-9), ("qwen3_5_moe", torch.float32, 5e-4)],
                         ids=["qwen3_5-fp64", "qwen3_5_moe-fp32"])
def test_a_packed_batch_equals_its_documents_run_one_by_one(case, dtype, tol):
    """Dense in fp64 (norms, RoPE and the Gated DeltaNet compute in it then), so that fp32 rounding, which
    these unit-scale layers amplify ~10x each (a document alone has other chunk boundaries), does not hide
    a leak behind a loose tolerance; the MoE in fp32 (grouped GEMMs take no fp64), against a leak of > 0.1."""
    theirs = reference(case)
    model = titanctl_model_of(theirs).to(dtype)
    doc_ids = packed_documents()
    # Each document's positions from 0, as it has alone (RoPE's table is fp32-exact only per position).
    starts = torch.cat([torch.ones(2, 1, dtype=torch.bool), doc_ids[:, 1:] != doc_ids[:, :-1]], dim=1)
    index = torch.arange(48).expand(2, 48)
    positions = index - torch.cummax(torch.where(starts, index, 0), dim=1).values
    packed = model(IDS.to(torch.long), attn_mask=dense_document_mask(doc_ids), positions=positions)
    leaked = model(IDS)
    for row in range(2):
        for doc in doc_ids[row].unique():
            where = (doc_ids[row] == doc).nonzero().flatten()
            alone = model(IDS[row : row + 1, where])
            assert (packed[row, where] - alone[0]).abs().max() < tol, (row, doc)
    assert (packed - leaked).abs().max() > 0.1  # the causal window lets state and conv taps cross over


def test_block_and_span_masks_give_the_same_boundaries_as_dense_masks():
    doc_ids = packed_documents()
    dense = document_starts(dense_document_mask(doc_ids), 2, 48, torch.device("cpu"))
    block = document_starts(block_document_mask(doc_ids), 2, 48, torch.device("cpu"))
    span = document_starts(SpanMask.of_documents(doc_ids, window=4), 2, 48, torch.device("cpu"))
    assert torch.equal(dense, block) and torch.equal(dense, span)
    assert dense[0].nonzero().flatten().tolist() == [0, 20] and dense[1].nonzero().flatten().tolist() == [0, 9, 10]
    assert document_starts(None, 2, 48, torch.device("cpu")) is None


@torch.no_grad()
def test_decoding_through_the_state_cache_equals_the_full_forward():
    """Prefill (chunked, from the cache's state) then one token at a time (the recurrent step); a second
    generation from position 0 starts from a fresh state and conv window. In fp64, as the packed test."""
    model = titanctl_model_of(reference("qwen3_5")).double()
    ids = IDS[:1, :14]
    full = model(ids)
    model.setup_kv_cache(16)
    for _ in range(2):
        prefill = model(ids[:, :9], input_pos=torch.arange(9))
        steps = [model(ids[:, t : t + 1], input_pos=torch.tensor([t])) for t in range(9, 14)]
        torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, rtol=0, atol=1e-9)
    model.clear_kv_cache()


def hf_config(**changes) -> dict:
    return {**qwen3_5_config().to_dict(), **changes}


@pytest.mark.parametrize("changes, says", [
    (dict(layer_types=["linear_attention"] * 3), "layer_types is"),
    (dict(linear_num_value_heads=5), "linear_num_key_heads 2 must divide linear_num_value_heads 5"),
    (dict(num_key_value_heads=3), "num_key_value_heads 3 must divide num_attention_heads 4"),
    (dict(linear_conv_kernel_dim=0), "linear_conv_kernel_dim is 0"),
], ids=["layer_types-length", "linear-heads", "kv-heads", "conv-kernel-0"])
def test_bad_config_json_is_refused_in_one_line(changes, says):
    with pytest.raises(CheckpointError) as err:
        args_from_hf_config(hf_config(**changes), max_seq_len=64)
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("field, value, says", [
    ("layer_types", ["linear_attention"] * 3, "layer_types has 3 entries for 4 layers"),
    ("linear_attention", {"num_key_heads": 3, "num_value_heads": 4, "key_head_dim": 16, "value_head_dim": 16,
                          "conv_kernel": 4}, "num_key_heads 3 must divide num_value_heads 4"),
    ("linear_attention", {"num_key_heads": 2, "num_value_heads": 4, "key_head_dim": 16, "value_head_dim": 16,
                          "conv_kernel": 0}, "linear_attention.conv_kernel"),
], ids=["layer_types-length", "linear-heads", "conv-kernel-0"])
def test_bad_titanctl_json_is_refused_in_one_line(field, value, says):
    raw = dataclasses.asdict(args_of(reference("qwen3_5")))
    raw[field] = value
    with pytest.raises(CheckpointError) as err:
        args_from_fields(raw, "titanctl.json")
    assert says in str(err.value) and "\n" not in str(err.value)


def test_the_blocks_refuse_args_they_cannot_build():
    args = args_of(reference("qwen3_5"))
    for bad, says in ((args.replace(layer_types=args.layer_types[:3]), "3 entries for 4 layers"),
                      (args.replace(linear_attention=dataclasses.replace(args.linear_attention, conv_kernel=0)),
                       "at least 1 tap")):
        with pytest.raises(ValueError, match=says):
            build_model(bad)


@torch.no_grad()
@pytest.mark.parametrize("taps", [1, 2])
def test_decoding_with_short_convs(taps):
    """A conv of one tap keeps no window, of two one input: decoding still equals the full forward."""
    args = args_of(reference("qwen3_5"))
    args = args.replace(linear_attention=dataclasses.replace(args.linear_attention, conv_kernel=taps))
    torch.manual_seed(0)
    model = build_model(args).double().eval()
    ids = IDS[:1, :6]
    full = model(ids)
    model.setup_kv_cache(8)
    prefill = model(ids[:, :3], input_pos=torch.arange(3))
    steps = [model(ids[:, t : t + 1], input_pos=torch.tensor([t])) for t in range(3, 6)]
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, rtol=0, atol=1e-9)

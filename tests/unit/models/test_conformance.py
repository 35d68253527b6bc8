"""What every family must do, run over the family list (tests/unit/models/families.py): its logits equal
transformers' on the same weights, Hugging Face state dicts convert to titanctl's and back bit for bit, a
folder that save_pretrained wrote comes back from DCP as it was and transformers loads the export with
the same logits, and the published flavors have their published sizes. (Every layout equals one process:
tests/distributed/test_family_layouts.py over the families' debug models, and test_layouts.py for Llama's
dense layouts.) A family's own mechanisms are tested in its own file."""

from __future__ import annotations

import pytest
import torch

from tests.unit.hf_reference import (
    IDS,
    args_of,
    assert_round_trip_keeps_the_folder,
    max_logit_delta,
    per_expert_layout,
    titanctl_model_of,
)
from tests.unit.models.families import (
    LLAMA3_TOKENIZER_ROWS,
    NOT_IN_SUITE,
    PUBLISHED_SIZES,
    REFERENCES,
    UNPUBLISHED,
)
from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint
from titanctl.checkpoint.hf.names import from_hf_state_dict, not_stored, to_hf_state_dict
from titanctl.models.registry import get_spec, spec_of
from titanctl.models.shapes import num_params


@pytest.fixture(scope="module", params=REFERENCES, ids=[r.case for r in REFERENCES])
def reference(request):
    """(the family's Reference, its transformers model)."""
    return request.param, request.param.build()


def test_logits_equal_transformers(reference):
    ref, theirs = reference
    ours = titanctl_model_of(theirs, state=ref.hf_state_dict(theirs))
    assert ours.args.family == ref.family
    tied = theirs.config.tie_word_embeddings
    assert (ours.output.weight is ours.tok_embeddings.weight) == tied
    d = max_logit_delta(ours, theirs)
    assert d <= ref.tol, f"{ref.case}: max |Δlogit| = {d:.3g}"


def test_hf_state_dicts_round_trip_bit_for_bit(reference):
    """Hugging Face -> titanctl -> Hugging Face gives the tensors save_pretrained writes (experts one per
    expert; a tied model no lm_head), from transformers' in-memory layout and from the on-disk one alike;
    titanctl -> Hugging Face -> titanctl gives titanctl's back, in fp32 and bf16."""
    ref, theirs = reference
    args = args_of(theirs)
    in_memory = ref.hf_state_dict(theirs)
    one_per_expert = bool(spec_of(args).hf.per_expert)  # the Hub's layout, else experts as transformers holds them
    on_disk = per_expert_layout(in_memory, args.moe.hidden_dim) if one_per_expert else dict(in_memory)
    if theirs.config.tie_word_embeddings:
        on_disk.pop("lm_head.weight")
    ours = from_hf_state_dict(in_memory, args)
    from_disk = from_hf_state_dict(on_disk, args)
    assert from_disk.keys() == ours.keys() and all(torch.equal(from_disk[k], ours[k]) for k in ours)
    back = to_hf_state_dict(ours, args)
    assert back.keys() == on_disk.keys() and all(torch.equal(back[k], on_disk[k]) for k in on_disk)
    for dtype in (torch.float32, torch.bfloat16):  # weights in it; integer state (a hash table) as it is
        cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in ours.items()}
        again = from_hf_state_dict(to_hf_state_dict(cast, args), args)
        assert again.keys() == cast.keys()
        if args.moe is None:  # dense layers convert name by name: in titanctl's own order
            assert list(again) == list(cast)
        for k, v in cast.items():  # state Hugging Face does not store (the expert bias) reads back as zeros
            assert not again[k].any() if not_stored(k, args) else again[k].dtype == v.dtype and torch.equal(again[k], v), k


def test_a_saved_folder_comes_back_from_dcp_and_transformers_loads_the_export(reference, tmp_path):
    import transformers

    ref, theirs = reference
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="200KB")  # shards and their index
    convert_checkpoint(tmp_path / "hf", tmp_path / "dcp", dst_format="dcp")
    state, args = load_checkpoint(tmp_path / "dcp")  # ModelArgs through titanctl.json
    assert args == args_of(theirs).replace(max_seq_len=args.max_seq_len)
    assert not any(state[k].any() for k in state if not_stored(k, args))  # what the folder lacks: zeros
    convert_checkpoint(tmp_path / "dcp", tmp_path / "back", dst_format="hf")
    config = assert_round_trip_keeps_the_folder(tmp_path / "hf", tmp_path / "back")
    rope = theirs.config.rope_parameters
    rope = rope.get("main", rope)  # DeepSeek-V4 nests its sliding layers' RoPE as "main"
    assert config["rope_theta"] == rope["rope_theta"]  # written for transformers 4.x
    ref.exported(config, theirs)
    reloaded = getattr(transformers, ref.model_class).from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    assert (reloaded.lm_head.weight is reloaded.model.embed_tokens.weight) == theirs.config.tie_word_embeddings
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, theirs(IDS).logits)


@pytest.mark.parametrize("family, flavor", list(PUBLISHED_SIZES), ids=[f"{f}-{v}" for f, v in PUBLISHED_SIZES])
def test_published_flavors_have_their_published_sizes(family, flavor):
    total, rel = PUBLISHED_SIZES[family, flavor]
    args = get_spec(family).flavors[flavor]
    if args.vocab_size <= 0:  # from the tokenizer: Llama 3's
        args = args.replace(vocab_size=LLAMA3_TOKENIZER_ROWS)
    n = num_params(args)  # from the shapes of a meta-device build; a tied table once
    assert n == total if rel == 0 else abs(n - total) / total < rel, (n, total)


def test_every_family_is_in_the_suite():
    from titanctl.models.registry import FAMILIES

    published = {family for family, _ in PUBLISHED_SIZES}
    assert {r.family for r in REFERENCES} | NOT_IN_SUITE.keys() == set(FAMILIES) == published | UNPUBLISHED.keys()
    assert not {r.family for r in REFERENCES} & NOT_IN_SUITE.keys()
    assert not published & UNPUBLISHED.keys()

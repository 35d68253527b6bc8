"""Llama 3.2 checkpoints come in and go out: a tied Hugging Face folder (as transformers writes it, no
``lm_head.weight``) converts to DCP and back bit for bit and still loads in transformers with equal
logits; a torchtitan DCP folder of Llama 3.2 1B's shape (which stores its output layer) is recognized
by its shapes and converts to a Hugging Face folder that transformers loads with RoPE factor 32."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.checkpoint.test_qwen3_checkpoints import safetensors_of
from tests.unit.hf_reference import tokens
from tests.unit.models.test_llama32_parity import ARGS, theirs  # noqa: F401 - the module fixture
from titanctl.checkpoint.convert import convert_checkpoint, load_checkpoint
from titanctl.errors import CheckpointError
from titanctl.models.llama.args import LLAMA3_FLAVORS

TOL = 1e-4



def test_tied_hf_folder_round_trips_through_dcp(theirs, tmp_path):  # noqa: F811
    import transformers

    theirs.save_pretrained(tmp_path / "hf")
    assert "lm_head.weight" not in safetensors_of(tmp_path / "hf")  # transformers writes a tied table once
    convert_checkpoint(tmp_path / "hf", tmp_path / "dcp", dst_format="dcp")
    state, args = load_checkpoint(tmp_path / "dcp")
    assert args.tie_embeddings and args.rope_scaling.factor == 32.0 and args.family == "llama3"
    convert_checkpoint(tmp_path / "dcp", tmp_path / "back", dst_format="hf")
    before, after = safetensors_of(tmp_path / "hf"), safetensors_of(tmp_path / "back")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["rope_scaling"]["factor"] == 32.0
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert back.lm_head.weight is back.model.embed_tokens.weight
    ids = tokens(ARGS.vocab_size)
    with torch.no_grad():
        assert (back(ids).logits - theirs(ids).logits).abs().max().item() <= TOL


def test_a_tied_model_goes_out_to_meta_with_its_output_layer_as_a_copy(theirs, tmp_path):  # noqa: F811
    theirs.save_pretrained(tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "meta", dst_format="meta")
    state = torch.load(tmp_path / "meta" / "consolidated.00.pth", weights_only=True)
    assert torch.equal(state["output.weight"], state["tok_embeddings.weight"])


def test_torchtitan_llama32_1b_shaped_checkpoint_converts_to_hf(tmp_path):
    """torchtitan saves Llama 3.2 1B with a separate output layer and no config: the shapes name the
    flavor (dim 2048, 32 query heads of 64, FFN 8192), here cut to one layer and a small vocabulary."""
    import torch.distributed.checkpoint as dcp
    import transformers

    flavor = LLAMA3_FLAVORS["1B"]
    args = flavor.replace(n_layers=1, vocab_size=256, max_seq_len=64, tie_embeddings=False)
    with torch.device("meta"):
        from titanctl.models.registry import build_model

        shapes = {k: v.shape for k, v in build_model(args).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16) for k, shape in shapes.items()}
    dcp.save(state, checkpoint_id=str(tmp_path / "tt"), no_dist=True)
    report = convert_checkpoint(tmp_path / "tt", tmp_path / "hf", src_format="torchtitan", dst_format="hf")
    assert "flavor 1B's with 1 layers" in report.origin
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_scaling"]["factor"] == 32.0 and config["intermediate_size"] == 8192
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.bfloat16)
    assert torch.equal(model.lm_head.weight, state["output.weight"])
    with pytest.raises(CheckpointError, match="unknown llama3 flavor '2B'"):
        convert_checkpoint(tmp_path / "tt", tmp_path / "x", src_format="torchtitan", flavor="2B")


def test_infer_tp_on_a_tied_llama32_folder_equals_generate(theirs, tmp_path):  # noqa: F811
    """A transformers-written Llama 3.2-shaped folder (tied, RoPE factor 32) with a tokenizer that fits
    its vocabulary: infer-tp's greedy tokens are generate()'s."""
    import shutil

    from tests.unit.data.test_hf_tokenizer import train_qwen_style
    from tests.unit.inference.test_infer_formats import NEW, PROMPT, reference
    from titanctl.data.tokenizer import Tokenizer
    from titanctl.inference.generate import run

    train_qwen_style(tmp_path / "tok")  # any byte-level BPE of fewer ids than the model's 512 rows
    theirs.save_pretrained(tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "tok" / name, tmp_path / "hf" / name)
    tokenizer = Tokenizer(tmp_path / "hf" / "tokenizer.json")
    report = run(tmp_path / "hf", PROMPT, max_new_tokens=NEW, temperature=0)
    assert report.source.args.tie_embeddings and report.source.args.rope_scaling.factor == 32.0
    ids = tokenizer.encode(PROMPT, bos=True, eos=False)
    assert report.generation.tokens == reference(theirs, ids, tokenizer.stop_tokens, tokenizer.vocab_size)

"""Document masking (model.attn_mask_type = block_causal): the mask derived from the tokens, and a
packed window computing each of its documents exactly as if that document ran alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titanctl.config.job_config import JobConfig
from titanctl.errors import ConfigError
from titanctl.models.common.args import ModelArgs, MoEArgs, RopeScaling
from titanctl.models.common.attention import AttentionKernel
from titanctl.models.common.decoder import Transformer
from titanctl.models.common.document_mask import (
    dense_document_mask,
    document_ids,
    document_mask,
    mask_form_for,
)
from titanctl.parallel.layouts.context_parallel import load_balanced_order
from titanctl.parallel.layouts.dims import ParallelDims
from titanctl.parallel.layouts.weight_init import initialize_weights
from titanctl.train.attention_masks import MicrobatchMasks

BOS, EOS = 1, 2
SEQ = 48
LLAMA = ModelArgs(
    dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=128, max_seq_len=SEQ,
    rope_scaling=RopeScaling(original_max_position_embeddings=16),
)  # fmt: skip
FAMILIES = {
    "llama3": LLAMA,
    "qwen3": LLAMA.replace(family="qwen3", qk_norm=True, rope_layout="halves", rope_scaling=None),
    "qwen3_moe": LLAMA.replace(family="qwen3_moe", qk_norm=True, rope_layout="halves", rope_scaling=None,
                               moe=MoEArgs(num_experts=4, top_k=2, hidden_dim=32)),
}  # fmt: skip


def test_a_document_starts_at_each_bos():
    tokens = torch.tensor([[7, 8, BOS, 5, EOS, BOS, BOS, 9, EOS]])
    assert document_ids(tokens, BOS).tolist() == [[0, 0, 1, 1, 1, 2, 3, 3, 3]]


def test_the_mask_keeps_each_token_inside_its_document_and_past():
    tokens = torch.tensor([[7, BOS, 5, EOS, BOS, 9]])
    mask = dense_document_mask(document_ids(tokens, BOS))[0, 0].int()  # (T, T)
    assert mask.tolist() == [
        [1, 0, 0, 0, 0, 0],  # the tail of a document begun before the window
        [0, 1, 0, 0, 0, 0],  # BOS opens a document: it sees itself only
        [0, 1, 1, 0, 0, 0],
        [0, 1, 1, 1, 0, 0],  # EOS belongs to the document it closes
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ]


def test_the_mask_of_some_positions_is_those_rows_and_columns_of_the_whole_mask():
    tokens = torch.randint(3, 50, (2, 16))
    tokens[0, [0, 5, 11]] = BOS
    tokens[1, [3, 4]] = BOS
    doc = document_ids(tokens, BOS)
    whole = dense_document_mask(doc)
    order = load_balanced_order(16, 2)
    mine = order.view(2, -1)[1]
    assert torch.equal(dense_document_mask(doc, mine, order), whole[:, :, mine][:, :, :, order])


def test_span_on_cpu_and_block_elsewhere():
    # FlexAttention has no backward on CPU in torch 2.13: training there takes the documents' starts (SpanMask).
    assert mask_form_for(torch.device("cpu")) == "span"
    assert mask_form_for(torch.device("cuda")) == "block"


def packed_window(vocab: int, seed: int = 0) -> tuple[torch.Tensor, list[slice]]:
    """One window of SEQ tokens: the tail of a document, then whole documents (BOS text EOS), the
    last one cut by the window's end; with the span of each document."""
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 13, 5, 16, 7]  # sums to SEQ
    pieces, spans, start = [], [], 0
    for i, n in enumerate(lengths):
        doc = torch.randint(3, vocab, (n,), generator=g)
        if i > 0:
            doc[0] = BOS  # the first piece is the tail of a document with its BOS in an earlier window
        if 0 < i < len(lengths) - 1:
            doc[-1] = EOS
        pieces.append(doc)
        spans.append(slice(start, start + n))
        start += n
    return torch.cat(pieces)[None], spans  # (1, SEQ)


def build(args: ModelArgs) -> Transformer:
    model = Transformer(args)
    initialize_weights(model, seed=0)
    return model


@pytest.mark.parametrize("form", ["span", "dense"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_document_of_a_packed_window_computes_as_if_alone(family, form):
    model = build(FAMILIES[family])
    window, spans = packed_window(model.args.vocab_size)
    inputs, labels = window[:, :-1], window[:, 1:]
    with torch.no_grad():
        packed = model(inputs, attn_mask=document_mask(inputs, BOS, form=form))  # (1, T, V)
        causal = model(inputs)
    packed_loss = F.cross_entropy(packed[0], labels[0], reduction="none")  # (T,)
    for span in spans:
        doc = window[:, span]
        with torch.no_grad():
            alone = model(doc[:, :-1])  # the document as its own sequence, starting at position 0
        alone_loss = F.cross_entropy(alone[0], doc[0, 1:], reduction="none")
        inside = slice(span.start, span.stop - 1)  # positions whose label lies in the same document
        torch.testing.assert_close(packed_loss[inside], alone_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[0, inside], alone[0], rtol=1e-5, atol=1e-5)
    later = spans[2].start
    assert (causal[0, later:] - packed[0, later:]).abs().max() > 1e-3  # the mask changed something


@pytest.mark.parametrize("first", [BOS, 17], ids=["starts-with-bos", "no-bos"])
def test_one_document_is_causal(first):
    model = build(LLAMA)
    inputs = torch.randint(3, LLAMA.vocab_size, (2, SEQ))
    inputs[:, 0] = first
    mask = document_mask(inputs, BOS)
    assert torch.equal(mask.dense()[:, 0], torch.ones(SEQ, SEQ, dtype=torch.bool).tril().expand(2, -1, -1))
    with torch.no_grad():
        torch.testing.assert_close(model(inputs, attn_mask=mask), model(inputs), rtol=1e-5, atol=1e-5)


def test_gradients_flow_through_the_span_mask():
    model = build(LLAMA)
    window, _ = packed_window(LLAMA.vocab_size)
    loss = F.cross_entropy(model(window[:, :-1], attn_mask=document_mask(window[:, :-1], BOS))[0], window[0, 1:])
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.slow  # compiles FlexAttention (inductor runs g++)
def test_the_block_mask_attends_like_the_dense_one():
    """FlexAttention (the form off CPU) runs forward-only on CPU: its mask must say the same,
    also for a rank's share of the queries over every key (context parallel)."""
    torch.manual_seed(0)
    tokens = torch.randint(3, 50, (2, 64))
    tokens[0, [0, 9, 40]] = BOS
    tokens[1, [20]] = BOS
    q, k, v = torch.randn(2, 4, 64, 16), torch.randn(2, 2, 64, 16), torch.randn(2, 2, 64, 16)
    kernel = AttentionKernel()
    order = load_balanced_order(64, 2)
    for q_pos, kv_pos in [(None, None), (order.view(2, -1)[0], order)]:
        qq = q if q_pos is None else q[:, :, q_pos]
        kk, vv = (k, v) if kv_pos is None else (k[:, :, kv_pos], v[:, :, kv_pos])
        dense = kernel(qq, kk, vv, document_mask(tokens, BOS, form="dense", q_positions=q_pos, kv_positions=kv_pos))
        block = kernel(qq, kk, vv, document_mask(tokens, BOS, form="block", q_positions=q_pos, kv_positions=kv_pos))
        torch.testing.assert_close(block, dense, rtol=1e-5, atol=1e-5)


def test_decoding_takes_no_mask():
    model = build(LLAMA)
    model.setup_kv_cache(SEQ)
    tokens = torch.randint(3, 50, (1, 4))
    with pytest.raises(ValueError, match="attn_mask is for training"):
        model(tokens, input_pos=torch.arange(4), attn_mask=document_mask(tokens, BOS))


def test_block_causal_needs_a_bos_token():
    cfg = JobConfig()
    cfg.model.attn_mask_type = "block_causal"
    dims = ParallelDims.from_config(cfg.parallelism, 1)
    with pytest.raises(ConfigError, match="finds documents by their BOS token") as e:
        MicrobatchMasks.build(cfg, dims, None, [])
    assert "\n" not in str(e.value)
    assert MicrobatchMasks.build(cfg, dims, BOS, [])(torch.tensor([[BOS, 5]])).shape == (1, 1, 2, 2)
    cfg.model.attn_mask_type = "causal"
    assert MicrobatchMasks.build(cfg, dims, BOS, [])(torch.tensor([[BOS, 5]])) is None


def test_estimate_memory_refuses_block_causal_on_cuda():
    """On CPU the step's dense masks run as they train (tests/unit/planning/test_estimate_memory.py); CUDA's
    compiled FlexAttention is not what fake tensors run."""
    from titanctl.planning.memory.estimate import plan_estimate

    cfg = JobConfig()
    cfg.model.attn_mask_type = "block_causal"
    with pytest.raises(ConfigError, match="block_causal on --device cpu only") as e:
        plan_estimate(cfg, 1, device="cuda")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_span_masks_train_as_dense_masks(family):
    """gpt-oss (sinks, its sliding layers narrowing the span mask to a window of 8) and DeepSeek-V3 (MLA: values
    narrower than keys) under a packed window's documents: logits and every gradient by spans equal the dense
    mask's (gpt-oss's dense route: its softmax written out)."""
    from titanctl.models.registry import build_model, flavor_args

    args = flavor_args(f"{family}:debugmodel").replace(n_layers=2, vocab_size=128, max_seq_len=SEQ)
    if family == "gpt_oss":
        args = args.replace(sliding_window=8)
    model = build_model(args)
    initialize_weights(model, seed=0)
    window, _ = packed_window(args.vocab_size)
    inputs = window[:, :-1].expand(2, -1).clone()
    inputs[1, 20] = BOS  # the second row with one more document
    results = {}
    for form in ("span", "dense"):
        model.zero_grad()
        logits = model(inputs, attn_mask=document_mask(inputs, BOS, form=form))
        logits.square().mean().backward()
        results[form] = logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(results["span"][0], results["dense"][0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert (model(inputs) - results["span"][0]).abs().max() > 1e-3  # the documents changed something
    assert results["span"][1].keys() == results["dense"][1].keys()
    for name, grad in results["span"][1].items():
        torch.testing.assert_close(grad, results["dense"][1][name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")

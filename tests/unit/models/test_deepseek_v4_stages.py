"""DeepSeek-V4's pipeline stages: two stages chained give the whole model's logits and gradients exactly, with
hash-routed layers in the second stage too (the boundary carries the token ids beside the streams)."""

from __future__ import annotations

import torch

from tests.unit.models.families import deepseek_v4_fp64
from titanctl.models.deepseek_v4.args import CSA, HCA, SLIDING, DeepseekV4Args
from titanctl.models.deepseek_v4.model import split_into_stage

ARGS = DeepseekV4Args(
    vocab_size=64, dim=32, n_layers=4, n_heads=2, head_dim=16, rope_head_dim=8, q_lora_rank=16, o_groups=2,
    o_lora_rank=8, sliding_window=8, layer_types=(HCA, CSA, SLIDING, CSA), compress_rates={CSA: 2, HCA: 4},
    index_n_heads=2, index_head_dim=8, index_topk=3, hc_mult=2, num_experts=4, top_k=2, moe_hidden_dim=16,
    mlp_layer_types=("hash_moe", "moe", "hash_moe", "moe"))


def test_two_stages_chained_equal_the_whole_model():
    model = deepseek_v4_fp64(ARGS)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    first, last = split_into_stage(model, [0, 1], True, False), split_into_stage(model, [2, 3], False, True)
    assert first.output is None and first.hc_head is None and last.tok_embeddings is None
    streams, ids = first(tokens)
    assert streams.shape == (2, 24, ARGS.hc_mult, ARGS.dim) and torch.equal(ids, tokens)
    chained = last(streams, ids)
    whole = model(tokens)
    assert torch.equal(chained, whole)
    chained.square().sum().backward()
    whole.square().sum().backward()
    for stage in (first, last):
        for name, p in stage.named_parameters():
            if p.grad is not None:
                assert torch.equal(p.grad, model.get_parameter(name).grad), name
    # The second stage's hash-routed layer routed by the ids: its experts got gradients.
    assert last.layers["2"].mlp.experts.gate_up_proj.grad.abs().sum() > 0

"""Ulysses context parallel in process: what it refuses, how key/value heads are repeated, and the
config key's values (the all-to-alls themselves: tests/distributed/test_ulysses_layouts.py)."""

from __future__ import annotations

import pytest
import torch

from titanctl.config.recipe import load_config
from titanctl.errors import ConfigError, ParallelError
from titanctl.models.registry import get_spec
from titanctl.parallel.layouts.ulysses import check_ulysses, repeat_kv_heads


def args(name: str, **overrides):
    return get_spec(name).flavors["debugmodel"].replace(**overrides)


def test_heads_must_divide_by_tp_times_cp():
    llama = args("llama3")  # 8 heads
    check_ulysses(llama, tp=2, cp=4, seq_len=64)
    with pytest.raises(ParallelError, match=r"n_heads = 8 is not divisible by .* = 2 x 8; use context_parallel_method = ring"):
        check_ulysses(llama, tp=2, cp=8, seq_len=64)
    with pytest.raises(ParallelError, match="seq_len divisible by context_parallel_degree = 3, but seq_len is 64"):
        check_ulysses(args("llama3", n_heads=6, n_kv_heads=2), tp=1, cp=3, seq_len=64)


def test_a_family_with_layers_other_than_attention_is_refused():
    check_ulysses(args("qwen3_5"), tp=1, cp=2, seq_len=64)  # Gated DeltaNet: linear_attention_ulysses.py
    with pytest.raises(ParallelError, match="deepseek_v4 has compressed_sparse_attention, heavily_compressed_attention "
                                            "layers; use context_parallel_method = ring"):
        check_ulysses(args("deepseek_v4"), tp=1, cp=2, seq_len=64)


@pytest.mark.parametrize("kv_heads, cp, copies", [(2, 2, 1), (2, 4, 2), (1, 2, 2), (4, 8, 2), (8, 4, 1)])
def test_key_value_heads_repeated_up_to_a_multiple_of_cp(kv_heads, cp, copies):
    k = torch.arange(kv_heads, dtype=torch.float32).view(1, kv_heads, 1, 1).expand(1, kv_heads, 3, 2)
    repeated = repeat_kv_heads(k, query_heads=8, cp=cp)
    assert repeated.shape[1] == kv_heads * copies and repeated.shape[1] % cp == 0
    # query head h reads key/value head h // (8 / H_kv) before and h // (8 / H_kv') after: the same head
    for h in range(8):
        assert repeated[0, h // (8 // repeated.shape[1]), 0, 0] == h // (8 // kv_heads)


def test_method_key_refuses_other_values():
    with pytest.raises(ConfigError, match="context_parallel_method.*ring.*ulysses"):
        load_config(None, ["--parallelism.context_parallel_method", "spiral"])

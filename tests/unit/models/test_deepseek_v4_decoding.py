"""DeepSeek-V4's decoding caches (titanctl/models/deepseek_v4/cache.py): decoding a token at a time, or a prompt
then tokens, or in chunks of any size, gives the logits of one forward over the whole sequence, in fp32.

The parity test's tiny model (one CSA, one HCA and one sliding layer, window 8), with 8 indexer heads: 48 tokens,
so that a query's keys are mostly compressed entries (CSA: 24 entries at rate 2, of which the indexer keeps 3;
HCA: 12 at rate 4). With the parity test's 2 heads, a fifth of the indexer's scores are exactly 0 (every head's
ReLU is 0) and the top-3 often ends among such ties, which topk breaks by the scores' length: the cache's (its
capacity) is not the forward's. 8 heads leave no tie at the top-k boundary (asserted).
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.models import test_deepseek_v4_parity as parity

TOL = 1e-4  # DESIGN.md's fp32 logits tolerance; measured 3.2e-6 at most


@pytest.fixture(scope="module")
def model():
    return parity.ours_of(parity.reference(index_n_heads=8)).float().eval()


def cached(model, ids: torch.Tensor, cuts: tuple[int, ...], length: int) -> torch.Tensor:
    """Logits (B, S, vocab) of ids fed in pieces ending at ``cuts`` through the caches (``length`` positions),
    which are left set up (a later call decodes over what this one left in them)."""
    bounds = [0, *cuts, ids.shape[1]]
    if model.cache_length != length:
        model.setup_kv_cache(length, batch_size=ids.shape[0])
    return torch.cat([model(ids[:, a:b], input_pos=torch.arange(a, b)) for a, b in zip(bounds, bounds[1:])], dim=1)


@torch.no_grad()
def test_decoding_equals_one_forward(model):
    ids = parity.tokens()  # (2, 48)
    seq = ids.shape[1]
    full = model(ids)
    scores = []
    indexer = model.layers["0"].self_attn.indexer
    hook = indexer.register_forward_hook(lambda module, args, out: scores.append(out[2]))
    model(ids)
    hook.remove()
    top = scores[0].topk(4, dim=-1).values  # (B, S, 4); -inf where fewer entries are visible
    boundary = torch.isfinite(top[..., 3])
    assert boundary.sum() > 40 and (top[..., 2] - top[..., 3])[boundary].min() > 1e-3  # no near tie at the 3rd
    try:
        # A token at a time; a prompt, tokens, then a chunk; chunks of every kind (across windows, odd sizes,
        # longer than the sliding window); caches longer than the sequence.
        for cuts, length in (((*range(1, seq),), seq), ((20, *range(21, 27)), seq + 5), ((1, 2, 3, 17, 30), seq + 16)):
            got = cached(model, ids, cuts, length)
            assert (got - full).abs().max() <= TOL, (cuts, length, (got - full).abs().max())
        # The caches are not cleared between generations (as titanctl's Decoder does): what a longer sequence
        # left in them is never read by a shorter one after it.
        other = parity.tokens(seed=7)[:, :30]
        got = cached(model, other, (9, 10, 11, 25), seq + 3)
        assert (got - model(other)).abs().max() <= TOL
    finally:
        model.clear_kv_cache()


def test_decoding_without_caches_is_refused_in_one_line(model):
    with pytest.raises(ValueError, match=r"^forward\(\.\.\., input_pos\) decodes through the caches: call "
                                         r"setup_kv_cache first$"):
        model(parity.tokens()[:1, :1], input_pos=torch.tensor([0]))

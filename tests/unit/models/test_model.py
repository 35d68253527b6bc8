"""Unit tests of the Llama 3.1 model: shapes, parameter counts, causality, RoPE, init."""

from __future__ import annotations

import math

import pytest
import torch

from titanctl.models.common.args import ModelArgs, RopeScaling
from titanctl.models.common.decoder import Transformer
from titanctl.models.common.rope import rope_frequencies
from titanctl.models.llama.args import LLAMA3_FLAVORS
from titanctl.models.shapes import num_params
from titanctl.parallel.layouts.weight_init import initialize_weights

TINY = ModelArgs(
    dim=64,
    n_layers=2,
    n_heads=8,
    n_kv_heads=2,
    vocab_size=256,
    max_seq_len=32,
    rope_scaling=RopeScaling(original_max_position_embeddings=16),
)
LLAMA3_VOCAB = 128256


def build(args: ModelArgs = TINY, seed: int = 0) -> Transformer:
    model = Transformer(args)
    initialize_weights(model, seed)
    return model.eval()


@pytest.mark.parametrize(
    "args",
    [
        TINY,
        TINY.replace(n_kv_heads=None),  # MHA
        TINY.replace(n_kv_heads=1, ffn_dim_multiplier=1.3, multiple_of=32),  # MQA, odd FFN
    ],
    ids=["gqa", "mha", "mqa-ffn-multiplier"],
)
def test_parameter_count_matches_args(args):
    model = Transformer(args)
    total = sum(p.numel() for p in model.parameters())
    assert total == num_params(args)
    assert total - model.tok_embeddings.weight.numel() == num_params(args, include_embedding=False)


@pytest.mark.parametrize("flavor, ffn_hidden", [("8B", 14336), ("70B", 28672), ("405B", 53248)])  # sizes: conformance
def test_published_flavor_shapes(flavor, ffn_hidden):
    args = LLAMA3_FLAVORS[flavor].replace(vocab_size=LLAMA3_VOCAB)
    assert args.ffn_hidden_dim == ffn_hidden
    assert args.head_dim == 128
    assert args.kv_heads == 8


@pytest.mark.parametrize("n_kv_heads", [None, 4, 2, 1])
def test_gqa_shapes(n_kv_heads):
    args = TINY.replace(n_kv_heads=n_kv_heads, n_layers=1)
    model = build(args)
    attn = model.layers["0"].attention
    kv_dim = (n_kv_heads or args.n_heads) * args.head_dim
    assert attn.wq.weight.shape == (args.dim, args.dim)
    assert attn.wk.weight.shape == attn.wv.weight.shape == (kv_dim, args.dim)
    tokens = torch.randint(0, args.vocab_size, (3, 11))
    with torch.no_grad():
        logits = model(tokens)
    assert logits.shape == (3, 11, args.vocab_size)
    assert torch.isfinite(logits).all()


def test_causal():
    model = build()
    tokens = torch.randint(0, TINY.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    t = 12
    changed[:, t] = (changed[:, t] + 1) % TINY.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-6)
    assert (after[:, t:] - before[:, t:]).abs().amax(dim=-1).min() > 0  # every later position sees it


def llama31_frequencies_loop(head_dim: int, theta: float, s: RopeScaling) -> list[float]:
    """Llama 3.1's scaled RoPE frequencies, written out one frequency at a time."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < s.original_max_position_embeddings / s.high_freq_factor:
            out.append(freq)  # high frequency: kept
        elif wavelen > s.original_max_position_embeddings / s.low_freq_factor:
            out.append(freq / s.factor)  # low frequency: scaled down
        else:  # in between: blend the two
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append((1 - smooth) * freq / s.factor + smooth * freq)
    return out


@pytest.mark.parametrize(
    "head_dim, theta, scaling",
    [
        (128, 500000.0, RopeScaling()),  # Llama 3.1 itself
        (8, 500000.0, RopeScaling(original_max_position_embeddings=16)),
        (64, 10000.0, RopeScaling(factor=4.0, low_freq_factor=2.0, high_freq_factor=8.0,
                                  original_max_position_embeddings=256)),
    ],
)
def test_rope_frequencies_match_loop(head_dim, theta, scaling):
    got = rope_frequencies(head_dim, theta, scaling)
    want = torch.tensor(llama31_frequencies_loop(head_dim, theta, scaling), dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == (head_dim // 2,)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    unscaled = rope_frequencies(head_dim, theta, None)
    torch.testing.assert_close(
        unscaled, torch.tensor([theta ** (-i / head_dim) for i in range(0, head_dim, 2)]), rtol=1e-6, atol=0
    )
    ratio = got / unscaled
    assert torch.isclose(ratio[-1], torch.tensor(1 / scaling.factor))  # slowest: divided by the factor
    if head_dim == 128:  # Llama 3.1 has all three regimes: kept, blended, divided
        assert ratio[0] == 1.0
        assert ((ratio < 1) & (ratio > 1 / scaling.factor + 1e-6)).any()


def test_meta_init_equals_cpu_init():
    with torch.device("meta"):
        meta_model = Transformer(TINY)
    meta_model.to_empty(device="cpu")
    initialize_weights(meta_model, seed=7)
    cpu_model = build(seed=7)
    other = build(seed=8)
    cpu_sd, meta_sd, other_sd = cpu_model.state_dict(), meta_model.state_dict(), other.state_dict()
    assert cpu_sd.keys() == meta_sd.keys()
    for name, value in cpu_sd.items():
        assert torch.equal(meta_sd[name], value), name
        if "norm" not in name:
            assert not torch.equal(other_sd[name], value), f"{name} does not depend on the seed"
    assert torch.equal(meta_model.rope_cache, cpu_model.rope_cache)
    tokens = torch.randint(0, TINY.vocab_size, (1, 8))
    with torch.no_grad():
        assert torch.equal(meta_model.eval()(tokens), cpu_model(tokens))


def test_init_statistics():
    args = TINY.replace(vocab_size=1024, n_layers=3)
    model = build(args, seed=3)
    sd = model.state_dict()
    for name, value in sd.items():
        if name.endswith("norm.weight"):
            assert torch.equal(value, torch.ones_like(value)), name
    # Normal truncated at 3 std has std 0.9866 of the untruncated one.
    out = sd["output.weight"]
    assert out.std().item() == pytest.approx(0.9866 * args.dim**-0.5, rel=0.03)
    assert out.abs().max() <= 3 * args.dim**-0.5
    assert sd["tok_embeddings.weight"].std().item() == pytest.approx(1.0, rel=0.03)
    for i in range(args.n_layers):
        assert sd[f"layers.{i}.attention.wq.weight"].std().item() == pytest.approx(0.02, rel=0.1)
        # Output projections shrink with depth (depth_init).
        want = 0.02 / math.sqrt(2 * (i + 1))
        assert sd[f"layers.{i}.attention.wo.weight"].std().item() == pytest.approx(want, rel=0.1)


def test_seeds_up_to_2_pow_64_draw_and_small_seeds_keep_their_numbers():
    """training.seed takes [0, 2^64): the per-parameter seed wraps modulo 2^64 instead of overflowing,
    and every seed that worked before draws exactly the numbers it drew then."""
    import zlib

    from titanctl.models.common.init import ParamInit
    from titanctl.parallel.layouts.weight_init import draw

    spec = ParamInit("normal", std=1.0)
    old = torch.Generator().manual_seed(5 * 1_000_003 + zlib.crc32(b"w"))
    assert torch.equal(draw(torch.Size([4]), spec, 5, "w"), torch.randn(4, generator=old))
    assert draw(torch.Size([4]), spec, 2**64 - 1, "w").isfinite().all()


@pytest.mark.slow
def test_first_loss_is_ln_vocab_plus_half_the_logit_variance():
    """Why the debug recipe's first loss is ~8.86, not ln(4352) = 8.38 (docs/training.md, "make train").

    The final RMSNorm gives unit-RMS features and output.weight is drawn with std dim^-1/2 (truncated
    at 3 std), so each logit is ~N(0, sigma^2) with sigma ~0.99. For Gaussian logits the expected
    log-sum-exp over V tokens is ln V + sigma^2 / 2, so the untrained model's loss is ~8.38 + 0.49.
    """
    import torch.nn.functional as F

    from tests.unit.trained_model import tokens_of
    from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer

    tok = Tokenizer(DEFAULT_TOKENIZER_PATH)
    args = LLAMA3_FLAVORS["debugmodel"].replace(vocab_size=tok.vocab_size, max_seq_len=256)
    model = build(args, seed=0)  # the debug recipe: seed 0, 6 layers, seq_len 256
    ids = torch.tensor(tokens_of("bundled", 20, tok)[: 8 * 257]).view(8, 257)
    with torch.no_grad():
        logits = model(ids[:, :-1]).float()  # (8, 256, V)
    variance = logits.var(dim=-1).mean().item()
    predicted = math.log(tok.vocab_size) + variance / 2
    assert 0.95 < variance < 1.0  # 0.9866^2 = 0.973
    assert torch.logsumexp(logits, dim=-1).mean().item() == pytest.approx(predicted, abs=0.01)
    assert predicted == pytest.approx(8.86, abs=0.01)
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).item()
    assert loss == pytest.approx(predicted, abs=0.1)  # the label's own logit averages ~0

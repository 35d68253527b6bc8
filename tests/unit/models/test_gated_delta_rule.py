"""The gated delta rule's two forms (titanctl.models.common.gated_delta_rule) against a naive per-token
reference written from the rule's definition in float64, forward and backward, with document resets
anywhere (inside chunks, at a chunk's first token, on consecutive tokens), a carried-in state, and a
length no chunk size divides; and against transformers' own chunked kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titanctl.models.common.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule

B, T, H, DK, DV = 2, 37, 3, 8, 6


def inputs(seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, DK, generator=gen), dim=-1) * DK**-0.5
    k = F.normalize(torch.randn(B, T, H, DK, generator=gen), dim=-1)
    v = torch.randn(B, T, H, DV, generator=gen)
    g = -F.softplus(torch.randn(B, T, H, generator=gen))  # decays in (0, 1)
    beta = torch.rand(B, T, H, generator=gen)
    state = torch.randn(B, H, DK, DV, generator=gen)
    return [t.to(dtype).requires_grad_() for t in (q, k, v, g, beta, state)]


RESETS = torch.zeros(B, T, dtype=torch.bool)
RESETS[0, [5, 8, 16]] = True  # inside a chunk of 8, and at a chunk's first token
RESETS[1, [16, 17, 30]] = True  # two in a row


def naive(q, k, v, g, beta, resets, state):
    """S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T q_t, a_t = 0 at a reset."""
    outs = []
    eye = torch.eye(q.shape[-1], dtype=q.dtype)
    for t in range(q.shape[1]):
        a = g[:, t].exp() * (1.0 if resets is None else (~resets[:, t]).to(q.dtype)[:, None])  # (B, H)
        kt, vt, bt = k[:, t], v[:, t], beta[:, t]
        outer = kt[..., :, None] * kt[..., None, :]  # (B, H, dk, dk)
        state = a[..., None, None] * ((eye - bt[..., None, None] * outer) @ state) \
            + bt[..., None, None] * kt[..., :, None] * vt[..., None, :]
        outs.append((state.transpose(-1, -2) @ q[:, t, ..., None])[..., 0])
    return torch.stack(outs, dim=1), state


def grads(fn, tensors, weights):
    out, state = fn(*tensors)
    loss = (out * weights[0]).sum() + (state * weights[1]).sum()
    return out.detach(), state.detach(), torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("resets", [None, RESETS], ids=["one-document", "resets"])
@pytest.mark.parametrize("chunk_size", [8, 64])
def test_chunked_and_recurrent_equal_the_naive_rule_forward_and_backward(resets, chunk_size):
    gen = torch.Generator().manual_seed(1)
    weights = (torch.randn(B, T, H, DV, generator=gen, dtype=torch.float64),
               torch.randn(B, H, DK, DV, generator=gen, dtype=torch.float64))
    ref = grads(lambda q, k, v, g, b, s: naive(q, k, v, g, b, resets, s), inputs(dtype=torch.float64), weights)
    forms = {
        "chunked": lambda q, k, v, g, b, s: chunk_gated_delta_rule(q, k, v, g, b, resets, s, chunk_size=chunk_size),
        "recurrent": lambda q, k, v, g, b, s: recurrent_gated_delta_rule(q, k, v, g, b, resets, s),
    }
    for name, form in forms.items():
        out, state, grad = grads(form, inputs(), [w.float() for w in weights])
        torch.testing.assert_close(out.double(), ref[0], rtol=0, atol=2e-6, msg=name)
        torch.testing.assert_close(state.double(), ref[1], rtol=0, atol=2e-6, msg=name)
        for mine, theirs, what in zip(grad, ref[2], ("q", "k", "v", "g", "beta", "state"), strict=True):
            torch.testing.assert_close(mine.double(), theirs, rtol=0, atol=2e-5, msg=f"{name} d{what}")


def test_gradients_of_the_output_alone_equal_the_naive_rule():
    """A loss on the outputs alone: the chunk scan's backward starts from no final-state gradient."""
    weight = torch.randn(B, T, H, DV, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    tensors = inputs(dtype=torch.float64)[:5]
    ref = torch.autograd.grad((naive(*tensors, RESETS, torch.zeros(B, H, DK, DV, dtype=torch.float64))[0]
                               * weight).sum(), tensors)
    tensors = inputs()[:5]
    mine = torch.autograd.grad((chunk_gated_delta_rule(*tensors, RESETS, chunk_size=8)[0] * weight.float()).sum(),
                               tensors)
    for a, b, what in zip(mine, ref, ("q", "k", "v", "g", "beta"), strict=True):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=2e-5, msg=f"d{what}")


def test_resets_are_documents_run_one_by_one():
    """A reset is a fresh start: the tokens from it on equal the rule run on them alone with no state."""
    q, k, v, g, beta, _ = (t.detach() for t in inputs())
    resets = torch.zeros(B, T, dtype=torch.bool)
    resets[:, 20] = True
    packed, _ = chunk_gated_delta_rule(q, k, v, g, beta, resets, chunk_size=8)
    alone, _ = chunk_gated_delta_rule(*(t[:, 20:] for t in (q, k, v, g, beta)), chunk_size=8)
    torch.testing.assert_close(packed[:, 20:], alone, rtol=0, atol=1e-6)
    leaked, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8)
    assert (leaked[:, 20:] - alone).abs().max() > 1e-2  # without the reset the state crosses over


@torch.no_grad()
def test_chunked_equals_transformers_kernel():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, g, beta, state = inputs()
    ours, our_state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, chunk_size=8)
    # transformers scales q by dk^-1/2 itself
    theirs, their_state = torch_chunk_gated_delta_rule(q * DK**0.5, k, v, g, beta, chunk_size=8, initial_state=state,
                                                      output_final_state=True)
    assert (ours - theirs).abs().max() < 1e-6 and (our_state - their_state).abs().max() < 1e-6

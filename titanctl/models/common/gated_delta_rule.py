"""The gated delta rule in plain torch: a chunked form for training and a per-token recurrence for decoding.

Per value head the state S (key_dim x value_dim) evolves token by token as
    S_t = a_t S_{t-1} + k_t d_t^T,   d_t = beta_t (v_t - (a_t S_{t-1})^T k_t),   o_t = S_t^T q_t
with a_t = exp(g_t) the decay. ``resets`` (B, T) marks tokens that start a new document: there a_t = 0,
so no state crosses a document boundary (a packed window then equals its documents run one by one).

The chunked form does the same in chunks of C tokens: within a chunk the deltas solve one unit lower
triangular system (I + L) d = beta v - beta A k S_0 (L_ij = beta_i D_ij k_i.k_j, D_ij the decay from
token j to token i, A_i from the chunk's start to i), so the sequence needs T / C sequential steps of
matrix products, not T. A reset inside a chunk zeroes the decays that cross it (D_ij, A_i, and those to
the chunk's end): exact, with no -inf in log space to cancel.
Inputs are (B, T, H, dim) with as many query/key heads as value heads (repeat them first); computed
in fp32 (fp64 for fp64 inputs, which tests use to see exactness past fp32 rounding), returned in v's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs: never below fp32 (bf16 states drift)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _to_heads_first(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.transpose(1, 2).to(compute_dtype(t.dtype)) for t in tensors]  # (B, H, T, ...)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    resets: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (B, T, H, dk), v (B, T, H, dv), g (log decay, <= 0) and beta (B, T, H), resets (B, T) bool,
    initial_state (B, H, dk, dv). Returns (out (B, T, H, dv), final state (B, H, dk, dv) in the compute dtype)."""
    batch, length, heads, dk = k.shape
    dv = v.shape[-1]
    out_dtype = v.dtype
    q, k, v = _to_heads_first(q, k, v)  # (B, H, T, d)
    g, beta = g.transpose(1, 2).to(q.dtype), beta.transpose(1, 2).to(q.dtype)  # (B, H, T)
    pad = (-length) % chunk_size
    if pad:  # padded tokens: beta 0 writes nothing, g 0 decays nothing, after every real token
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (length + pad) // chunk_size
    q, k, v = (t.reshape(batch, heads, n, chunk_size, -1) for t in (q, k, v))  # (B, H, n, C, d)
    g, beta = g.reshape(batch, heads, n, chunk_size), beta.reshape(batch, heads, n, chunk_size)

    cum = g.cumsum(-1)  # (B, H, n, C): log decay from the chunk's start through token i
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()  # j <= i
    if resets is None:
        same = lower  # (C, C)
        from_start = cum.exp()
        to_end = (cum[..., -1:] - cum).exp()
        chunk_decay = cum[..., -1].exp()
    else:
        reset = F.pad(resets.to(torch.int32), (0, pad)).reshape(batch, 1, n, chunk_size)
        seg = reset.cumsum(-1)  # resets at or before token i in its chunk: equal seg, no reset between
        same = lower & (seg[..., :, None] == seg[..., None, :])  # (B, 1, n, C, C)
        from_start = cum.exp() * (seg == 0)
        to_end = (cum[..., -1:] - cum).exp() * (seg == seg[..., -1:])
        chunk_decay = cum[..., -1].exp() * (seg[..., -1] == 0)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~same, float("-inf")).exp()  # D_ij (.., C, C)

    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # I + L once its diagonal reads as ones
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * from_start[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # (B, H, n, C, C), D_ii = 1 on the diagonal
    q_start = q * from_start[..., None]
    k_end = k * to_end[..., None]

    state = (initial_state.to(q.dtype) if initial_state is not None
             else q.new_zeros(batch, heads, dk, dv))  # (B, H, dk, dv)
    outs = []
    for c in range(n):  # the one sequential part: a chunk's deltas need the state before it
        delta = u[:, :, c] - w[:, :, c] @ state  # (B, H, C, dv)
        outs.append(q_start[:, :, c] @ state + scores[:, :, c] @ delta)
        state = chunk_decay[:, :, c, None, None] * state + k_end[:, :, c].transpose(-1, -2) @ delta
    out = torch.stack(outs, dim=2).reshape(batch, heads, n * chunk_size, dv)[:, :, :length]
    return out.transpose(1, 2).to(out_dtype), state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    resets: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule token by token (decoding's step, a few tokens at a time); same shapes as
    ``chunk_gated_delta_rule``."""
    batch, length, heads, dk = k.shape
    dv = v.shape[-1]
    out_dtype = v.dtype
    q, k, v = _to_heads_first(q, k, v)
    decay = g.transpose(1, 2).to(q.dtype).exp()  # (B, H, T)
    if resets is not None:
        decay = decay * (~resets.bool())[:, None, :]
    beta = beta.transpose(1, 2).to(q.dtype)
    state = initial_state.to(q.dtype) if initial_state is not None else q.new_zeros(batch, heads, dk, dv)
    outs = []
    for t in range(length):
        state = state * decay[:, :, t, None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, :, t])  # what the state already says of v
        delta = beta[:, :, t, None] * (v[:, :, t] - predicted)
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    out = torch.stack(outs, dim=1) if outs else v.new_zeros(batch, 0, heads, dv)  # (B, T, H, dv)
    return out.to(out_dtype), state

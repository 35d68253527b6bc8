"""The gated delta rule in plain torch: a chunked form for training and a per-token recurrence for decoding.

Per value head the state S (key_dim x value_dim) evolves token by token as
    S_t = a_t S_{t-1} + k_t d_t^T,   d_t = beta_t (v_t - (a_t S_{t-1})^T k_t),   o_t = S_t^T q_t
with a_t = exp(g_t) the decay. ``resets`` (B, T) marks tokens that start a new document: there a_t = 0,
so no state crosses a document boundary (a packed window then equals its documents run one by one).

The chunked form does the same in chunks of C tokens: within a chunk the deltas solve one unit lower
triangular system (I + L) d = beta v - beta A k S_0 (L_ij = beta_i D_ij k_i.k_j, D_ij the decay from
token j to token i, A_i from the chunk's start to i), so the sequence needs T / C sequential steps of
matrix products, not T; everything else (``_ChunkScan``'s own backward too, from the saved per-chunk states)
is batched over all chunks at once. A reset inside a chunk zeroes the decays that cross it (D_ij, A_i, and
those to the chunk's end): exact, with no -inf in log space to cancel.
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


def _chunks_first(t: torch.Tensor, n: int, chunk_size: int) -> torch.Tensor:
    """(B, n C, H, ...) -> (n, B, H, C, ...) contiguous in the compute dtype: one copy, after which every
    chunk's slice is one block of memory and each product below is a plain batched matmul."""
    batch, _, heads = t.shape[:3]
    chunked = t.reshape(batch, n, chunk_size, heads, *t.shape[3:]).movedim((1, 3), (0, 2))
    return chunked.to(compute_dtype(t.dtype)).contiguous()


class _ChunkScan(torch.autograd.Function):
    """The sequential part: chunk by chunk, the deltas from the state before the chunk and the state after it,
    S_{c+1} = gamma_c S_c + K_c^T (U_c - W_c S_c). Only these two products per chunk are sequential, forward and
    backward: the outputs (and in backward every gradient but the states') are batched over all chunks from the
    saved states, where autograd through the loop would make one full-size gradient buffer per chunk slice.

    u (n, N, C, dv), w, q_start, k_end (n, N, C, dk), scores (n, N, C, C), chunk_decay (n, N), state (N, dk, dv)
    with N = batch x heads; returns the output (n, N, C, dv) and the final state (N, dk, dv)."""

    @staticmethod
    def forward(ctx, u, w, q_start, scores, k_end, chunk_decay, state):
        n = u.shape[0]
        states = u.new_empty(n + 1, *state.shape)  # states[c]: before chunk c
        deltas = torch.empty_like(u)
        states[0] = state
        # bmm then an elementwise op, not baddbmm: on CPU baddbmm runs one addmm per batch matrix
        for c in range(n):
            torch.sub(u[c], torch.bmm(w[c], states[c]), out=deltas[c])
            torch.add(states[c] * chunk_decay[c, :, None, None], torch.bmm(k_end[c].transpose(1, 2), deltas[c]),
                      out=states[c + 1])
        before = states[:n]
        out = torch.matmul(scores, deltas).add_(torch.matmul(q_start, before))
        ctx.save_for_backward(w, q_start, scores, k_end, chunk_decay, before, deltas)
        return out, states[n].clone()

    @staticmethod
    def backward(ctx, d_out, d_final):
        w, q_start, scores, k_end, chunk_decay, before, deltas = ctx.saved_tensors
        n = w.shape[0]
        d_out = d_out.contiguous()
        d_deltas = torch.matmul(scores.transpose(-1, -2), d_out)  # completed in the loop by the state's part
        from_out = torch.matmul(q_start.transpose(-1, -2), d_out)  # d S_c from chunk c's own output
        d_after = torch.empty_like(before)  # d S_{c+1}
        d_state = torch.zeros_like(before[0]) if d_final is None else d_final.contiguous()
        for c in reversed(range(n)):
            d_after[c] = d_state
            d_deltas[c] += torch.bmm(k_end[c], d_state)
            d_state = d_state * chunk_decay[c, :, None, None] + from_out[c] - torch.bmm(w[c].transpose(1, 2),
                                                                                         d_deltas[c])
        d_w = torch.matmul(d_deltas, before.transpose(-1, -2)).neg_()
        d_q_start = torch.matmul(d_out, before.transpose(-1, -2))
        d_scores = torch.matmul(d_out, deltas.transpose(-1, -2))
        d_k_end = torch.matmul(deltas, d_after.transpose(-1, -2))
        d_decay = (d_after * before).sum((-1, -2))
        return d_deltas, d_w, d_q_start, d_scores, d_k_end, d_decay, d_state


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
    pad = (-length) % chunk_size
    if pad:  # padded tokens: beta 0 writes nothing, g 0 decays nothing, after every real token
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, 0, 0, pad)), F.pad(beta, (0, 0, 0, pad))
    n = (length + pad) // chunk_size
    q, k, v, g, beta = (_chunks_first(t, n, chunk_size) for t in (q, k, v, g, beta))  # (n, B, H, C, ...)

    cum = g.cumsum(-1)  # (n, B, H, C): log decay from the chunk's start through token i
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()  # j <= i
    if resets is None:
        same = lower  # (C, C)
        from_start = cum.exp()
        to_end = (cum[..., -1:] - cum).exp()
        chunk_decay = cum[..., -1].exp()
    else:
        reset = F.pad(resets.to(torch.int32), (0, pad)).reshape(batch, n, 1, chunk_size).transpose(0, 1)
        seg = reset.cumsum(-1)  # (n, B, 1, C) resets at or before token i in its chunk: equal seg, none between
        same = lower & (seg[..., :, None] == seg[..., None, :])  # (n, B, 1, C, C)
        from_start = cum.exp() * (seg == 0)
        to_end = (cum[..., -1:] - cum).exp() * (seg == seg[..., -1:])
        chunk_decay = cum[..., -1].exp() * (seg[..., -1] == 0)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~same, float("-inf")).exp()  # D_ij (.., C, C)

    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # I + L once its diagonal reads as ones
    # one solve for both right-hand sides, u = (I + L)^-1 beta v and w = (I + L)^-1 beta A k: substitution, not
    # an explicit inverse times them (measured: 20x the error of transformers' solve in the LoRA parity test)
    rhs = torch.cat([v * beta[..., None], k_beta * from_start[..., None]], dim=-1)
    u, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([dv, dk], dim=-1)
    scores = (q @ k.transpose(-1, -2)) * decay  # (n, B, H, C, C), D_ii = 1 on the diagonal
    q_start = q * from_start[..., None]
    k_end = k * to_end[..., None]

    state = (initial_state.to(q.dtype) if initial_state is not None
             else q.new_zeros(batch, heads, dk, dv)).reshape(batch * heads, dk, dv)

    def flat(t: torch.Tensor) -> torch.Tensor:  # (n, B, H, ...) -> (n, B H, ...)
        return t.reshape(n, batch * heads, *t.shape[3:])

    out, state = _ChunkScan.apply(flat(u), flat(w).contiguous(), flat(q_start), flat(scores), flat(k_end),
                                  flat(chunk_decay), state.contiguous())
    out = out.view(n, batch, heads, chunk_size, dv).movedim((0, 2), (1, 3)).reshape(batch, n * chunk_size, heads, dv)
    return out[:, :length].to(out_dtype), state.view(batch, heads, dk, dv)


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

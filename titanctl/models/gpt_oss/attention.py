"""gpt-oss's attention: the shared grouped-query attention with attention sinks, one learned logit per
query head that joins every softmax and attends to no value (the weights of the real keys then sum to
less than 1).

No fused kernel of torch 2.13 takes such a logit. Training attends through ``span_attention`` (a
``SpanMask``: the causal one without a mask, or the documents' starts and the layer's window), which
merges the sink into each chunk's log-sum-exp, exact, and never holds a T x S mask or score. A dense
mask (decoding's cache, references) runs the softmax written out (``sink_attention``), which holds the
(B, H, T, S) scores in fp32, a chunk of queries at a time past ``SINK_CHUNK_ELEMENTS``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from torch.utils.checkpoint import checkpoint

from titanctl.models.common.args import ModelArgs
from titanctl.models.common.attention import Attention, AttentionKernel
from titanctl.models.common.init import INPUT, ParamInit
from titanctl.models.common.span_attention import span_attention
from titanctl.models.common.span_mask import SpanMask

# Scores of one chunk of queries in sink_attention: batch x heads x queries x keys (1 GiB in fp32). Above it
# the queries go in chunks, each recomputed in backward, so that no layer holds all its (B, H, T, S) scores.
SINK_CHUNK_ELEMENTS = 2**28


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor
) -> torch.Tensor:
    """Attention of q (B, H, T, head_dim) over k, v (B, H_kv, S, head_dim) whose softmax also takes
    ``sinks`` (H,), one logit per query head that attends to no value. ``mask``: a dense bool mask
    broadcast to (B, H, T, S), True = attend; None is causal (T == S). Scores and softmax in fp32;
    the output in q's dtype. Long sequences go SINK_CHUNK_ELEMENTS of scores at a time, each chunk's
    recomputed in backward (the same numbers: each query's softmax is its own)."""
    if isinstance(mask, BlockMask):
        raise ValueError("attention with sinks takes a dense bool mask, not a FlexAttention BlockMask")
    batch, heads, length, _ = q.shape
    groups = heads // k.shape[1]
    if groups > 1:  # key/value head j serves query heads j * groups .. (j + 1) * groups - 1
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, S, head_dim)
    k, v = k.float(), v.float()
    rows = max(1, SINK_CHUNK_ELEMENTS // (batch * heads * k.shape[2]))
    if rows >= length:
        return _sink_rows(q, k, v, mask, sinks, 0)
    chunks = []
    for start in range(0, length, rows):
        part = None if mask is None else mask[..., start : start + rows, :]
        args = (q[:, :, start : start + rows], k, v, part, sinks, start)
        chunks.append(checkpoint(_sink_rows, *args, use_reentrant=False) if torch.is_grad_enabled()
                      else _sink_rows(*args))
    return torch.cat(chunks, dim=2)


def _sink_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor,
               first: int) -> torch.Tensor:
    """``sink_attention`` of the queries at positions first.. (q (B, H, rows, head_dim)) over fp32 k, v
    (B, H, S, head_dim); ``mask`` their rows, None: causal."""
    batch, heads, rows, _ = q.shape
    scores = torch.matmul(q.float(), k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, rows, S)
    if mask is None:
        queries = torch.arange(first, first + rows, device=q.device)
        mask = torch.arange(k.shape[2], device=q.device)[None, :] <= queries[:, None]  # (rows, S)
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, heads, 1, 1).expand(batch, heads, rows, 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # the sink's share dropped
    return torch.matmul(weights, v).to(q.dtype)  # (B, H, rows, head_dim)


class SinkAttentionKernel(AttentionKernel):
    """Training's attention with ``sinks`` (a keyword: hooks on the positional q, k, v, mask leave it alone):
    span attention under a SpanMask or causally (None), the softmax written out under a dense mask."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        mask: SpanMask | torch.Tensor | BlockMask | None = None, *, sinks: torch.Tensor,
    ) -> torch.Tensor:
        if mask is None and q.shape[2] == k.shape[2]:
            mask = SpanMask.causal(q.shape[2], device=q.device)
        if isinstance(mask, SpanMask):
            return span_attention(q, k, v, mask, sinks)
        return sink_attention(q, k, v, mask, sinks)


def _local(param: torch.Tensor) -> torch.Tensor:
    """A parameter as this rank's tensor (a head-sharded DTensor under tensor parallelism: its heads)."""
    return param.to_local() if hasattr(param, "to_local") else param


class SinkAttention(Attention):
    """``Attention`` with ``sinks`` (n_heads,): split with the query heads under tensor parallelism
    (the family's TP plan), each rank's attention reading its own heads'."""

    def __init__(self, args: ModelArgs, layer_id: int = 0):
        super().__init__(args, layer_id)
        self.sinks = nn.Parameter(torch.empty(args.n_heads))
        self.kernel = SinkAttentionKernel()

    def kernel_inputs(self) -> dict[str, torch.Tensor]:
        return {"sinks": _local(self.sinks)}

    def attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return sink_attention(q, k, v, mask, _local(self.sinks))

    def param_inits(self, depth: int) -> dict[str, ParamInit]:
        return super().param_inits(depth) | {"sinks": INPUT}

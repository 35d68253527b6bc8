"""The lightning indexer's training objective (DeepSeek-V3.2's eq. 3-4, which DeepSeek-V4's CSA layers
reuse): KL from the attention's distribution over the compressed entries (summed over heads, then
normalized: the target) to the softmax of the indexer's scores, per query, averaged over the queries that
see an entry. Dense (the warm-up) over every visible entry, sparse over the entries the indexer chose.

The target is detached and the indexer reads detached inputs, so the loss trains the indexer alone and the
indexer gets no other gradient (its top-k has none). Its gradient joins the model's through the model's
output (``AddLossGradient``): the output's value, and so the logged loss, stay the language model's."""

from __future__ import annotations

import torch


def indexer_kl(attention: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor,
               rows_total: float | None = None) -> torch.Tensor:
    """attention (B, S, n): the attention's probabilities on the compressed entries summed over its heads
    (detached); scores (B, S, n): the indexer's; allowed (B, S, n): the entries the loss spans. -> the mean KL
    (a scalar), or the sum of the rows' KL / ``rows_total`` when given (a context-parallel rank's share of the
    mean)."""
    target = attention / attention.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(attention.dtype).tiny)
    log_q = scores.masked_fill(~allowed, float("-inf")).log_softmax(dim=-1)
    log_q = log_q.masked_fill(~allowed, 0.0)  # no -inf x 0 where the target is 0 anyway
    log_p = target.clamp_min(torch.finfo(target.dtype).tiny).log()
    kl = (target * (log_p - log_q)).sum(dim=-1)  # (B, S)
    rows = allowed.any(dim=-1)
    if rows_total is not None:
        return kl[rows].sum() / max(rows_total, 1.0)
    return kl[rows].mean() if rows.any() else kl.sum() * 0


class AddLossGradient(torch.autograd.Function):
    """Returns ``out`` unchanged; in backward adds the gradient of ``loss`` (a scalar) to the graph."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape = loss.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return grad_out, torch.ones(ctx.loss_shape, dtype=grad_out.dtype, device=grad_out.device)

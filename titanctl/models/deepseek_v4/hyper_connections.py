"""Manifold-constrained hyper-connections (mHC): the residual is ``hc_mult`` streams; each block reads a
learned mix of them, and writes back its output spread over the streams plus the streams mixed by a
doubly stochastic matrix (Sinkhorn-Knopp), so the residual cannot grow with depth."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanctl.models.deepseek_v4.args import DeepseekV4Args
from titanctl.models.deepseek_v4.attention import RMSNorm, compute_dtype


class HyperConnection(nn.Module):
    def __init__(self, args: DeepseekV4Args):
        super().__init__()
        n = self.n = args.hc_mult
        self.iters, self.eps = args.hc_sinkhorn_iters, args.hc_eps
        self.input_norm = RMSNorm(n * args.dim, args.norm_eps, weighted=False)
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * args.dim))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, S, n, D) -> (post (B, S, n), comb (B, S, n, n), the block's input (B, S, D))."""
        n, dt = self.n, compute_dtype(streams)
        flat = self.input_norm(streams.flatten(2).to(dt))
        mixes = F.linear(flat, self.fn.to(dt))
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.to(dt).split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.to(dt).unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed


def write_back(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams: the block's output spread by ``post`` plus the old streams mixed by comb (summed over
    comb's first axis: comb^T @ streams)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The last collapse of the streams into one, before the final norm."""

    def __init__(self, args: DeepseekV4Args):
        super().__init__()
        n = args.hc_mult
        self.eps = args.hc_eps
        self.input_norm = RMSNorm(n * args.dim, args.norm_eps, weighted=False)
        self.fn = nn.Parameter(torch.empty(n, n * args.dim))
        self.base = nn.Parameter(torch.zeros(n))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        dt = compute_dtype(streams)
        mixes = F.linear(self.input_norm(streams.flatten(2).to(dt)), self.fn.to(dt))
        pre = torch.sigmoid(mixes * self.scale.to(dt) + self.base.to(dt)) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)

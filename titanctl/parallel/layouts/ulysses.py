"""Ulysses context parallelism: attention runs on the whole sequence for a share of the heads.

Under ``parallelism.context_parallel_method = "ulysses"`` each CP rank holds a contiguous 1/cp of the
sequence (tokens, labels, RoPE rows or positions; cut in place by ``ulysses_context_parallel_ctx``).
Everything outside attention is per token, so it runs on that shard unchanged. Around every attention
kernel (``AttentionKernel``), hooks put by ``enable_ulysses``:

1. before it, one all-to-all each of q, k and v from (all heads, this rank's positions) to (this rank's
   H / cp heads, every position): the kernel then sees the whole sequence, in its natural order, so the
   mask it is given is the ordinary one-process mask (causal, block-causal, sliding windows by layer
   type) with no remapping, and per-head inputs (gpt-oss's ``sinks``) are cut to this rank's heads;
2. after it, one all-to-all of the output back to (all heads, this rank's positions).

The all-to-alls are autograd functions whose backward is the reverse all-to-all, so gradients flow to
every rank's projections; a per-head parameter's gradient lands on the rank that holds its heads and
the usual sum over the CP ranks completes it.

No load balancing is needed (or done): every rank attends over the whole sequence for the same number
of heads, so causal and document masks cost every rank the same. MLA (DeepSeek-V3) needs nothing of
its own: its kernel gets per-head q, k, v after the up projection.

Heads: the query heads must divide by tensor_parallel_degree x cp. Key/value heads (grouped-query
attention) fewer than that, or not divisible by it, are repeated (each head copied to the ranks whose
query heads read it) up to lcm(local KV heads, cp) before the all-to-all: exact, at the cost of sending
those copies; their gradients sum back through the repeat.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from titanctl.errors import ParallelError
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.attention import AttentionKernel
from titanctl.parallel.layouts.context_parallel import buffers_cut_in_place

METHODS = ("ring", "ulysses", "ulysses_ring")
HEAD_DIM, SEQ_DIM = 1, 2  # of q, k, v and the output inside the kernel: (B, H, T, head_dim)
# the layers Ulysses splits by heads: softmax attention here, Gated DeltaNet in linear_attention_ulysses.py
ATTENTION_LAYERS = ("full_attention", "sliding_attention", "linear_attention")


def check_ulysses(args: ModelArgs, tp: int, cp: int, seq_len: int) -> None:
    """Fail before any collective if ``args``' attention cannot be split cp ways by heads after TP."""
    if seq_len % cp:
        raise ParallelError(f"ulysses context parallel needs training.seq_len divisible by "
                            f"context_parallel_degree = {cp}, but seq_len is {seq_len}")
    if args.n_heads % (tp * cp):
        raise ParallelError(
            f"ulysses context parallel splits the heads: model n_heads = {args.n_heads} is not divisible by "
            f"tensor_parallel_degree x context_parallel_degree = {tp} x {cp}; use context_parallel_method = ring"
        )
    others = sorted({t for t in args.layer_types if t not in ATTENTION_LAYERS})
    if others:
        raise ParallelError(
            f"ulysses context parallel splits attention layers only, but {args.family} has {', '.join(others)} "
            "layers; use context_parallel_method = ring"
        )


class _AllToAll(torch.autograd.Function):
    """Rank r sends chunk j of dim 0 to rank j and gets rank j's chunk r there; backward: the reverse."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # after contiguous(): empty_like keeps a strided input's strides
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def sequence_to_heads(x: Tensor, group, cp: int, all_to_all=None) -> Tensor:
    """(B, H, T / cp, d) on each rank -> (B, H / cp, T, d): rank r's heads r*H/cp.., positions in rank order.
    ``all_to_all``: an autograd all-to-all of dim 0 to use instead of ``group``'s (in-process tests' threads)."""
    b, h, t, d = x.shape
    chunks = x.view(b, cp, h // cp, t, d).transpose(0, 1)  # (cp: the heads' rank, B, H / cp, T / cp, d)
    got = _AllToAll.apply(chunks, group) if all_to_all is None else all_to_all(chunks)
    # (cp: the positions' rank, B, H / cp, T / cp, d)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d)


def heads_to_sequence(x: Tensor, group, cp: int, all_to_all=None) -> Tensor:
    """(B, H / cp, T, d) -> (B, H, T / cp, d): the inverse of ``sequence_to_heads``."""
    b, h, t, d = x.shape
    chunks = x.view(b, h, cp, t // cp, d).permute(2, 0, 1, 3, 4)  # (cp: the positions' rank, B, H / cp, T / cp, d)
    got = _AllToAll.apply(chunks, group) if all_to_all is None else all_to_all(chunks)
    # (cp: the heads' rank, B, H / cp, T / cp, d)
    return got.transpose(0, 1).reshape(b, h * cp, t // cp, d)


def repeat_kv_heads(k: Tensor, query_heads: int, cp: int) -> Tensor:
    """k (B, H_kv, T, d) with each head repeated so that the count divides by ``cp`` (lcm(H_kv, cp)
    heads; itself when H_kv already does); grouped-query attention reads the copies as it read the head."""
    kv_heads = k.shape[HEAD_DIM]
    wanted = math.lcm(kv_heads, cp)
    if wanted == kv_heads:
        return k
    if query_heads % wanted:
        raise ParallelError(f"ulysses context parallel: {query_heads} query heads over {kv_heads} key/value heads "
                            f"cannot be split over {cp} ranks")
    return k.repeat_interleave(wanted // kv_heads, dim=HEAD_DIM)


_ULYSSES_KERNELS: weakref.WeakSet = weakref.WeakSet()  # the attention kernels hooked already


def enable_ulysses(model: torch.nn.Module, cp_mesh) -> None:
    """Put the all-to-alls around every attention kernel of ``model`` (idempotent)."""
    group, cp, rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()

    def to_heads(module, args, kwargs):
        q, k, v, *mask = args
        heads = q.shape[HEAD_DIM]
        k, v = repeat_kv_heads(k, heads, cp), repeat_kv_heads(v, heads, cp)
        q, k, v = (sequence_to_heads(t, group, cp) for t in (q, k, v))
        # per-head inputs (gpt-oss's sinks (H,)): this rank's heads
        kwargs = {name: t.view(cp, -1)[rank] for name, t in kwargs.items()}
        return (q, k, v, *mask), kwargs

    def to_sequence(module, args, kwargs, out):
        return heads_to_sequence(out, group, cp)

    for module in model.modules():
        if isinstance(module, AttentionKernel) and module not in _ULYSSES_KERNELS:
            module.register_forward_pre_hook(to_heads, with_kwargs=True)
            module.register_forward_hook(to_sequence, with_kwargs=True)
            _ULYSSES_KERNELS.add(module)


@contextlib.contextmanager
def ulysses_context_parallel_ctx(
    cp_mesh, *, buffers: list[Tensor], seq_dims: list[int], no_restore: set[Tensor]
) -> Iterator[None]:
    """Cut ``buffers`` in place to this rank's contiguous 1/cp along ``seq_dims`` (e.g. ``[inputs, labels,
    model.rope_cache]`` with ``[1, 1, 0]``: all of one length), restored on exit except ``no_restore``."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    lengths = {buf.shape[dim] for buf, dim in zip(buffers, seq_dims, strict=True)}
    if len(lengths) != 1 or next(iter(lengths)) % cp:
        raise ParallelError(f"ulysses context parallel needs buffers of one length divisible by {cp}, got {lengths}: "
                            "build the model with max_seq_len == seq_len")
    share = next(iter(lengths)) // cp
    with buffers_cut_in_place(buffers, seq_dims, no_restore, torch.arange(rank * share, (rank + 1) * share)):
        yield

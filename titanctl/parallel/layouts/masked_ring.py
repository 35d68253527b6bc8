"""Ring attention under a mask (documents, sliding windows, attention sinks): each CP rank keeps its queries and
meets the other ranks' keys and values one shard at a time, so no rank ever holds the whole sequence's K/V.

A rank's kernel gets its queries q (B, H, T / cp, d), its own keys and values, and the mask of its queries over
every rank's keys in rank order (columns j T / cp .. (j + 1) T / cp - 1 are rank j's keys: ``kv_positions`` of
``document_cp_positions``, whatever order of positions the ranks hold). Nothing here assumes an order. Training
hands it a ``RingMask`` (ring_mask.py: the documents' starts, a window, the order), from which each block's
(T / cp) x (T / cp) bool is made when it is attended and dropped after; a dense (B, 1, T / cp, T) bool or a
FlexAttention BlockMask are taken too.

Forward, at step s = 0 .. cp - 1 rank r attends its queries to the keys and values of rank (r - s) mod cp under
that block of the mask, with torch's fused CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``, which
returns the block's log-sum-exp; elsewhere the softmax written out), and merges the block into its output by
log-sum-exp (an online softmax, accumulators in fp32 or wider). An attention sink (gpt-oss: one logit per head in
the denominator only) joins the log-sum-exp once, at the end.

Which blocks are sent: a ``RingMask`` gives every rank the cp x cp table of blocks holding any allowed (query,
key) pair by itself; from another mask every rank reads its row off its rows of the mask, and one all-gather of
those booleans (once per mask, cached with it) tells every rank the whole table. At step s a rank's K/V go
straight from their owner r - s (a shift, not a relay around the ring), so a block the mask leaves empty is
neither computed nor sent; under a sliding window, or documents shorter than a shard, most of the blocks far
from the diagonal never move. Memory: a rank holds its own K/V (one stacked copy in the inputs' dtype, saved
for backward), at most one visiting shard and one block of the mask: O(S / cp) (a ``RingMask`` itself is O(S)).

Backward recomputes each block from the saved output and final log-sum-exp (exact: the fused backward takes the
merged statistics), the visiting shard fetched again from its owner by the same schedule; each block's dK and dV
partials go straight back to their owner, which sums them into its own. dQ stays local; a sink's gradient is this
rank's rows' share (the CP ranks' gradients are summed like every parameter's).
"""

from __future__ import annotations

import threading
import types
import weakref

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from titanctl import _torch_compat
from titanctl.models.common.attention import AttentionKernel
from titanctl.models.common.softmax_blocks import merge, sparse_block_backward, sparse_block_forward, work_dtype
from titanctl.parallel.layouts.ring_mask import RingMask

SEQ_DIM = 2  # of q, k, v inside the kernel: (B, H, T, d)


class RingPeers:
    """The CP ranks as the masked ring reaches them: point-to-point shifts and one small all-gather."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def gather_rows(self, row: Tensor) -> Tensor:
        """(cp,) of this rank -> (cp, cp): every rank's, row r = rank r's."""
        rows = [torch.empty_like(row) for _ in range(self.size)]
        dist.all_gather(rows, row, group=self.group)
        return torch.stack(rows)

    def exchange(self, send: Tensor | None, dst: int, like: Tensor | None, src: int) -> Tensor | None:
        """Send ``send`` to ``dst`` (None: nothing) while receiving a tensor shaped ``like`` from ``src``."""
        if _is_fake(like if like is not None else send):  # estimate-memory: no data to move, only the buffer
            return None if like is None else torch.empty_like(like, memory_format=torch.contiguous_format)
        works, got = [], None
        if send is not None:
            works.append(dist.isend(send.contiguous(), group=self.group, group_dst=dst))
        if like is not None:
            got = torch.empty_like(like, memory_format=torch.contiguous_format)
            works.append(dist.irecv(got, group=self.group, group_src=src))
        for work in works:
            work.wait()
        return got


class MaskBlocks:
    """The blocks of a mask of this rank's queries over every rank's keys, one per key shard."""

    def __init__(self, mask: RingMask | Tensor | BlockMask, cp: int):
        self.mask, self.cp = mask, cp
        total = mask.shape[-1]
        if total % cp:
            raise ValueError(f"masked ring attention: the mask's {total} keys do not split into {cp} equal shards")
        self.keys = total // cp

    def block(self, j: int) -> Tensor:
        """(B or 1, 1, T_q, T / cp) bool: which of rank j's keys each query sees."""
        if isinstance(self.mask, RingMask):
            return self.mask.block(j)
        cols = slice(j * self.keys, (j + 1) * self.keys)
        if isinstance(self.mask, Tensor):
            return self.mask[..., cols].bool()
        # a BlockMask: its mask_mod evaluated on the block's indices
        batch, rows, device = self.mask.shape[0], self.mask.shape[-2], self.mask.kv_num_blocks.device
        b = torch.arange(batch, device=device)[:, None, None]
        q_idx = torch.arange(rows, device=device)[None, :, None]
        kv_idx = torch.arange(cols.start, cols.stop, device=device)[None, None, :]
        return self.mask.mask_mod(b, torch.zeros_like(b), q_idx, kv_idx).expand(batch, rows, self.keys)[:, None]

    def row(self) -> Tensor:
        """(cp,) uint8: whether this rank's queries see any key of each shard."""
        return torch.tensor([bool(self.block(j).any()) for j in range(self.cp)], dtype=torch.uint8)


# id(mask) -> (a weak reference to it, its (cp, cp) table of non-empty blocks); a tensor cannot key a
# WeakKeyDictionary (its == is elementwise), and the id is dropped with the mask
_TABLES: dict[int, tuple[weakref.ref, list[list[bool]]]] = {}
_TABLES_LOCK = threading.Lock()


def _is_fake(t: Tensor | None) -> bool:
    return isinstance(t, _torch_compat.FAKE_TENSOR.get())


def needed_blocks(blocks: MaskBlocks, peers) -> list[list[bool]]:
    """[r][j]: whether rank r's queries see any of rank j's keys (one all-gather per mask: every layer and the
    backward reuse it). Fake masks (estimate-memory) have no values to read: every block counts, the most the
    ring can hold and send."""
    if isinstance(blocks.mask, RingMask):
        return blocks.mask.table()
    if _is_fake(blocks.mask if isinstance(blocks.mask, Tensor) else None):
        return [[True] * peers.size for _ in range(peers.size)]
    key = id(blocks.mask)
    with _TABLES_LOCK:
        ref, table = _TABLES.get(key, (None, None))
    if ref is not None and ref() is blocks.mask:
        return table
    table = peers.gather_rows(blocks.row()).bool().tolist()
    with _TABLES_LOCK:
        _TABLES[key] = (weakref.ref(blocks.mask), table)
    weakref.finalize(blocks.mask, _TABLES.pop, key, None)
    return table


class MaskedRingAttention(torch.autograd.Function):
    """Attention of this rank's queries over every rank's keys and values under a mask (module docstring)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, blocks: MaskBlocks, peers) -> Tensor:
        work = work_dtype(q)
        rank, cp = peers.rank, peers.size
        table = needed_blocks(blocks, peers)
        dk = k.shape[-1]  # MLA's values are narrower than its keys: one buffer of both, side by side
        # (B, H_kv, T / cp, d_k + d_v) in the inputs' dtype (bf16 travels as bf16): what the other ranks fetch
        mine = torch.cat([k, v], dim=-1)
        qw = q.to(work)
        out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=work, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=work, device=q.device)
        for step in range(cp):
            src, dst = (rank - step) % cp, (rank + step) % cp
            if step == 0:
                kv = mine
            else:  # my shard to dst if its queries see it; src's to me if mine see it
                kv = peers.exchange(mine if table[dst][rank] else None, dst, mine if table[rank][src] else None, src)
            if table[rank][src]:
                keys, values = kv[..., :dk].to(work), kv[..., dk:].to(work)
                out_b, lse_b = sparse_block_forward(qw, keys, values, blocks.block(src).to(q.device))
                out, lse = merge(out, lse, out_b, lse_b)
            del kv
        if sinks is not None:  # the sink joins each head's denominator once
            total = torch.logaddexp(lse, sinks.to(work).view(1, -1, 1))
            out, lse = out * torch.exp(lse - total)[..., None], total
        ctx.save_for_backward(q, mine, out, lse, sinks)
        ctx.blocks, ctx.peers, ctx.table, ctx.dk, ctx.dtypes = blocks, peers, table, dk, (q.dtype, k.dtype, v.dtype)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, mine, out, lse, sinks = ctx.saved_tensors
        qw = q.to(out.dtype)
        blocks, peers, table = ctx.blocks, ctx.peers, ctx.table
        rank, cp = peers.rank, peers.size
        grad = grad_out.to(qw.dtype).contiguous()
        dq = torch.zeros_like(qw)
        dk = ctx.dk
        # (B, H_kv, T / cp, d_k + d_v): my keys' and values' gradient, summed here in the kernels' dtype
        dkv = torch.zeros(mine.shape, dtype=qw.dtype, device=mine.device)
        for step in range(cp):
            src, dst = (rank - step) % cp, (rank + step) % cp
            if step == 0:
                kv = mine
            else:
                kv = peers.exchange(mine if table[dst][rank] else None, dst, mine if table[rank][src] else None, src)
            partial = None
            if table[rank][src]:
                block = blocks.block(src).to(qw.device)
                keys, values = kv[..., :dk].to(qw.dtype), kv[..., dk:].to(qw.dtype)
                dq_b, dk_b, dv_b = sparse_block_backward(grad, qw, keys, values, out, lse, block)
                dq += dq_b
                partial = torch.cat([dk_b, dv_b], dim=-1)
            del kv
            if step == 0:
                if partial is not None:
                    dkv += partial
                continue
            # the partial back to its owner src; dst's partial of my shard to me
            got = peers.exchange(partial, src, dkv if table[dst][rank] else None, dst)
            if got is not None:
                dkv += got
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # d out / d sink = -p_sink out per row: the sink's gradient is -sum of p_sink (dO . out)
            p_sink = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)  # (B, H, T_q)
            dsinks = -(p_sink * (grad * out).sum(-1)).sum(dim=(0, 2)).to(sinks.dtype)
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        return dq.to(q_dtype), dkv[..., :dk].to(k_dtype), dkv[..., dk:].to(v_dtype), dsinks, None, None


@torch.compiler.disable  # point-to-point sends inside: a compiled block runs this one call eagerly
def masked_ring_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: RingMask | Tensor | BlockMask, peers, sinks: Tensor | None = None
) -> Tensor:
    """This rank's attention output (B, H, T / cp, d) under ``mask`` (its queries over all ranks' keys, rank
    order), K/V passed between ``peers`` (``RingPeers`` of the CP group) as the module docstring says."""
    return MaskedRingAttention.apply(q, k, v, sinks, MaskBlocks(mask, peers.size), peers)


_RING_KERNELS: weakref.WeakSet = weakref.WeakSet()  # the attention kernels routed already


def enable_masked_ring(model: torch.nn.Module, cp_mesh) -> None:
    """Route every attention kernel of ``model`` given a mask through the masked ring (idempotent). Calls without
    a mask (causal) keep the kernel's own path: torch's ring attention under ``context_parallel``."""
    peers = RingPeers(cp_mesh.get_group())

    def routed(own_forward):
        def forward(self, q, k, v, mask=None, **inputs):
            if mask is None:
                return own_forward(q, k, v, mask, **inputs)
            sinks = inputs.pop("sinks", None)
            if inputs:
                raise NotImplementedError(f"masked ring attention takes sinks only, not {', '.join(inputs)}")
            return masked_ring_attention(q, k, v, mask, peers, sinks)

        return forward

    for module in model.modules():
        if isinstance(module, AttentionKernel) and module not in _RING_KERNELS:
            module.forward = types.MethodType(routed(module.forward), module)
            _RING_KERNELS.add(module)

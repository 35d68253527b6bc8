"""Context parallel for Gated DeltaNet layers: the recurrent state and the conv's halo pass between CP
ranks as a prefix scan over the sequence's chunks, not as an all-gather of the sequence.

Under CP the sequence is cut into 2 x cp chunks and rank r holds chunks r and 2cp-1-r (the head-tail order
of torch's ring and of ``document_context_parallel_ctx`` alike), so each Gated DeltaNet call sees two
non-adjacent pieces. Two things cross a chunk boundary:

- The causal conv reads the K - 1 inputs before each token: each rank all-gathers its pieces' last K - 1
  conv inputs (cp x 2 x (K - 1) rows of the conv's channels) and prepends to each piece the tail of the chunk
  before it in sequence order (zeros before chunk 0).
- The delta rule's state. Over one chunk the final state is affine in the state the chunk starts from,
  S_out = M S_in + B per head (M: key_dim x key_dim, from the chunk's keys, decays and betas alone; B: the
  final state from zero), and each output is affine in it too, o_t = o_t(0) + S_in^T m_t. Columns of the state
  evolve independently, so one run of the chunked kernel with the values widened by key_dim zero columns and
  the initial state [0 | I] gives all four: B and M as the final state's two column blocks, o(0) and m as the
  outputs'. Each rank all-gathers every chunk's (M, B) (cp x 2 x heads x key_dim x (key_dim + value_dim)
  numbers per sequence), composes them in sequence order (chunk 0 starts from zero; chunk c + 1 from
  M_c S_c + B_c), and adds S_in^T m_t to its pieces' outputs. A document start inside a chunk zeroes M from
  there on (the kernel's resets), so no state crosses a document boundary on any rank.

Gradients flow through both gathers (functional all-gathers whose backward reduce-scatters), so every rank's
keys, values, gates and conv inputs get the gradient of the later chunks that their state reached.
Documents (block_causal): the mask each rank gets is the one of its queries over all keys (gathered order; in
training a ``RingMask``, which holds the documents' starts); whether token P sees token P - lag, read off that
mask, gives both the resets and the conv's valid taps.

Under ``context_parallel_method = "ulysses_ring"`` the scan is the ring level: first linear_attention_ulysses.py's
all-to-all over the rank's u Ulysses peers gives it the ring group's positions for H_k / u key-head groups, then
this scan runs over the r = cp / u groups (``cp_mesh`` is the ring mesh), each group holding chunks i and
2r-1-i of 2r (the step orders the positions head-tail over the groups for Gated DeltaNet families), and the
reverse all-to-all follows the rule. The mask is then one per layer type; the full layers' ``RingMask`` (the
group's queries over all keys) holds the documents.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from titanctl import _torch_compat
from titanctl.errors import ParallelError
from titanctl.models.common.gated_delta_rule import chunk_gated_delta_rule
from titanctl.models.common.gated_deltanet import GatedDeltaNet
from titanctl.parallel.layouts.context_parallel import load_balanced_order
from titanctl.parallel.layouts.ring_mask import RingMask


class GatedDeltaNetScan:
    """A Gated DeltaNet layer's conv and delta rule over this CP rank's two chunks (``sequence_scan``)."""

    def __init__(self, cp_mesh):
        self.mesh = cp_mesh
        self.cp = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self.chunks = (self.rank, 2 * self.cp - 1 - self.rank)  # this rank's pieces, in the order it holds them
        gather = (_torch_compat.CP_ALL_GATHER_AUTOGRAD if _torch_compat.torch_at_least("2.13")
                  else _torch_compat.CP_ALL_GATHER_AUTOGRAD_BEFORE_2_13).get()
        self._gather_fn = gather

    def _gather(self, pieces: Tensor) -> Tensor:
        """(2, ...) this rank's pieces -> (2cp, ...) every rank's, rank by rank (autograd-aware)."""
        return self._gather_fn(pieces.contiguous(), 0, self.mesh)

    def _slot(self, chunk: int) -> int:
        """Where chunk ``chunk`` of the sequence sits among the gathered pieces."""
        return 2 * chunk if chunk < self.cp else 2 * (2 * self.cp - 1 - chunk) + 1

    def _same_document(self, attn_mask, batch: int, length: int, lags: int, device) -> Tensor | None:
        """(B, T / cp, lags + 1) bool: whether this rank's token at position P is of the same document as the
        token at P - lag (False before the window's start); None under the causal default."""
        if attn_mask is None:
            return None
        if isinstance(attn_mask, dict):  # masks by layer type (ulysses_ring): the full layers' holds the documents
            attn_mask = attn_mask["full_attention"]
        if isinstance(attn_mask, RingMask):  # what training hands it: the documents' starts
            return attn_mask.sees_back(lags).expand(batch, -1, -1)
        total = length * self.cp
        order = load_balanced_order(total, self.cp).to(device)  # key index -> position
        mine = order.view(self.cp, -1)[self.rank]  # (T / cp,) this rank's positions
        key_index = torch.empty_like(order)
        key_index[order] = torch.arange(total, device=device)  # position -> key index
        earlier = mine[:, None] - torch.arange(lags + 1, device=device)[None, :]  # (T / cp, lags + 1)
        keys = key_index[earlier.clamp(min=0)]
        queries = torch.arange(length, device=device)[:, None].expand_as(keys)
        if isinstance(attn_mask, BlockMask):
            b = torch.arange(batch, device=device)[:, None, None]
            same = attn_mask.mask_mod(b, torch.zeros_like(b), queries[None], keys[None]).expand(batch, -1, -1)
        elif isinstance(attn_mask, Tensor) and attn_mask.dim() == 4:
            same = attn_mask[:, 0][:, queries, keys].expand(batch, -1, -1)  # (B, T / cp, lags + 1)
        else:
            raise ValueError("Gated DeltaNet under context parallel reads document boundaries from one "
                             f"RingMask, a (B, 1, T / cp, T) mask or a BlockMask; got {type(attn_mask).__name__}")
        return same.bool() & (earlier >= 0)[None]

    def _check_pieces(self, length: int, halo: int) -> int:
        if length % 2:
            raise ParallelError(f"Gated DeltaNet under context parallel needs two equal chunks per rank, got {length} "
                                "tokens")
        if length // 2 < halo:
            raise ParallelError(f"Gated DeltaNet under context parallel: each of the 2 x cp = {2 * self.cp} chunks "
                                f"({length // 2} tokens) must hold the conv's {halo} earlier inputs; use a longer "
                                "training.seq_len or a smaller context_parallel_degree")
        return length // 2

    def conv(self, mixed: Tensor, weight: Tensor, attn_mask) -> Tensor:
        """The causal depthwise conv (SiLU after) of this rank's conv inputs ``mixed`` (B, T / cp, C), each
        piece continuing the chunk before it in sequence order."""
        batch, length, channels = mixed.shape
        halo = weight.shape[-1] - 1
        n = self._check_pieces(length, halo)
        pieces = mixed.view(batch, 2, n, channels)
        if halo == 0:
            return F.silu(mixed * weight[:, 0, -1])
        every = self._gather(pieces[:, :, n - halo:].transpose(0, 1))  # (2cp, B, K - 1, C): each piece's tail
        zeros = mixed.new_zeros(batch, halo, channels)
        before = torch.stack([every[self._slot(c - 1)] if c > 0 else zeros for c in self.chunks], dim=1)
        padded = torch.cat([before, pieces], dim=2)  # (B, 2, K - 1 + n, C)
        same = self._same_document(attn_mask, batch, length, halo, mixed.device)
        same = None if same is None else same.view(batch, 2, n, halo + 1)
        out = pieces * weight[:, 0, -1]
        for lag in range(1, halo + 1):  # tap K-1-lag reads the input lag back, if it is of the same document
            term = padded[:, :, halo - lag: halo - lag + n] * weight[:, 0, -1 - lag]
            out = out + (term if same is None else term * same[..., lag, None])
        return F.silu(out).reshape(batch, length, channels)

    def rule(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, attn_mask) -> Tensor:
        """The gated delta rule's outputs (B, T / cp, H, dv) of this rank's two pieces, each from the state
        the chunks before it leave (shapes as ``chunk_gated_delta_rule``)."""
        batch, length, heads, dk = k.shape
        dv = v.shape[-1]
        n = self._check_pieces(length, 0)
        same = self._same_document(attn_mask, batch, length, 1, q.device)
        resets = None if same is None else ~same[..., 1]  # (B, T / cp): a document's first token

        def by_piece(t: Tensor) -> Tensor:  # (B, 2n, ...) -> (2B, n, ...): the two pieces as batch rows
            return t.reshape(batch, 2, n, *t.shape[2:]).transpose(0, 1).reshape(2 * batch, n, *t.shape[2:])

        widened = torch.cat([v, v.new_zeros(batch, length, heads, dk)], dim=-1)  # (B, T / cp, H, dv + dk)
        identity = torch.eye(dk, dtype=v.dtype, device=v.device).expand(2 * batch, heads, dk, dk)
        start = torch.cat([v.new_zeros(2 * batch, heads, dk, dv), identity], dim=-1)  # [0 | I]
        out, final = chunk_gated_delta_rule(by_piece(q), by_piece(k), by_piece(widened), by_piece(g), by_piece(beta),
                                            resets=None if resets is None else by_piece(resets),
                                            initial_state=start)
        # final (2B, H, dk, dv + dk) = [B | M] of each piece; out (2B, n, H, dv + dk) = [o(0) | m]
        maps = self._gather(final.to(v.dtype).view(2, batch, heads, dk, dv + dk))  # (2cp, B, H, dk, dv + dk)
        states = {}
        state = v.new_zeros(batch, heads, dk, dv)  # (B, H, dk, dv): chunk 0 starts from nothing
        for chunk in range(max(self.chunks) + 1):
            states[chunk] = state
            m = maps[self._slot(chunk)]
            state = m[..., dv:] @ state + m[..., :dv]
        out = out.view(2, batch, n, heads, dv + dk)
        pieces = [out[p, ..., :dv] + torch.einsum("bthk,bhkv->bthv", out[p, ..., dv:], states[c])
                  for p, c in enumerate(self.chunks)]
        return torch.stack(pieces, dim=1).reshape(batch, length, heads, dv)


def check_linear_attention_cp(args, seq_len: int, cp: int, ring_of: str = "context_parallel_degree") -> None:
    """Refuse, before any rank connects, chunks too short to hold the conv's earlier inputs. ``cp``: the ranks (or
    ulysses_ring's groups) the scan runs over, ``ring_of`` how the config gives that number."""
    la = args.linear_attention
    if la is None or "linear_attention" not in args.layer_types:
        return
    chunk = seq_len // (2 * cp)
    if chunk < la.conv_kernel - 1:
        raise ParallelError(f"{ring_of} = {cp} cuts training.seq_len {seq_len} into chunks of {chunk} "
                            f"tokens, fewer than the {la.conv_kernel - 1} earlier inputs the Gated DeltaNet conv "
                            f"reads: use seq_len >= {2 * cp * (la.conv_kernel - 1)} or a smaller degree")


def enable_gated_deltanet_context_parallel(model: torch.nn.Module, cp_mesh) -> None:
    """Give every Gated DeltaNet layer of ``model`` the scan over ``cp_mesh`` (idempotent)."""
    for module in model.modules():
        if isinstance(module, GatedDeltaNet) and module.sequence_scan is None:
            module.sequence_scan = GatedDeltaNetScan(cp_mesh)

"""DeepSeek-V4's attention: shared-KV multi-query attention over a sliding window, plus the compressed
entries of a CSA (compressor + lightning indexer + top-k) or HCA (compressor only) layer, with learned
sinks, partial interleaved RoPE and the grouped output projection. Training: a whole sequence from position 0
(or this process's pieces of it, ``sequence_pieces``); decoding: the positions after those already in the
layer's caches (cache.py), with the same numbers."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from titanctl.models.common.args import YarnScaling
from titanctl.models.common.rope import yarn_frequencies
from titanctl.models.common.sequence_pieces import WHOLE_SEQUENCE, WholeSequence
from titanctl.models.deepseek_v4.args import CSA, SLIDING, DeepseekV4Args
from titanctl.models.deepseek_v4.cache import CompressorCache, LayerCache, WindowCache
from titanctl.models.deepseek_v4.indexer_loss import indexer_kl


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 tensors, fp64 for fp64 ones: the precision the reference's float32 islands
    (norms, RoPE, softmaxes) keep, without lowering an fp64 model."""
    return torch.promote_types(x.dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weighted: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if weighted else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(compute_dtype(x))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            h = self.weight.to(h.dtype) * h
        return h.to(x.dtype)


def local(param: torch.Tensor) -> torch.Tensor:
    """A parameter as this rank's tensor: under tensor parallelism a DTensor, split with the heads (its own
    heads' values) or replicated (whole)."""
    return param.to_local() if hasattr(param, "to_local") else param


def rope_frequencies(args: DeepseekV4Args, compressed: bool) -> torch.Tensor:
    """One frequency per rotated pair: the main RoPE for sliding layers, the compressed one (its own theta,
    YaRN if set) for CSA/HCA layers and their compressors."""
    dim = args.rope_head_dim
    if compressed and args.compress_yarn is not None:
        y = args.compress_yarn
        freqs, _ = yarn_frequencies(dim, args.compress_rope_theta, YarnScaling(
            factor=y.factor, original_max_position_embeddings=y.original_max_position_embeddings,
            beta_fast=y.beta_fast, beta_slow=y.beta_slow))
        return freqs  # the reference keeps cos/sin unscaled (attention factor 1)
    theta = args.compress_rope_theta if compressed else args.rope_theta
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def cos_sin(freqs: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Angles in fp32 (as the reference computes them), one per pair, repeated for the pair's two channels."""
    angles = positions.to(torch.float32)[:, None] * freqs.to(device=positions.device, dtype=torch.float32)[None]
    angles = angles.repeat_interleave(2, dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``cos.shape[-1]`` channels of ``x`` (..., S, D) in interleaved pairs."""
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    r = rope.to(compute_dtype(x))
    rotated = torch.stack((-r[..., 1::2], r[..., 0::2]), dim=-1).flatten(-2)
    out = r * cos.to(r.dtype) + rotated * sin.to(r.dtype)
    return torch.cat([nope, out.to(x.dtype)], dim=-1)


def window_pool(kv: torch.Tensor, gate: torch.Tensor, rate: int, overlap: bool,
                before: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Softmax-gated pooling of each closed window of ``rate`` tokens into one entry: (B, S, C) -> (B, n, D).

    ``overlap`` (CSA): C = 2D, two series per token; entry w pools window w's second series with window
    w - 1's first (width 2 x rate, stride rate); ``before`` (kv, gate), each (B, rate, C): the window before
    the first (default: none, zeros gated at -inf). Else (HCA) C = D, one series, disjoint windows.
    """
    b, s, c = kv.shape
    n = s // rate
    kv = kv[:, : n * rate].view(b, n, rate, c)
    gate = gate[:, : n * rate].view(b, n, rate, c)
    if overlap:
        d = c // 2
        if before is None:
            pad_kv, pad_gate = kv.new_zeros(b, 1, rate, d), gate.new_full((b, 1, rate, d), float("-inf"))
        else:
            pad_kv, pad_gate = before[0][:, None, :, :d], before[1][:, None, :, :d]
        previous_kv = torch.cat([pad_kv, kv[:, :-1, :, :d]], dim=1)
        previous_gate = torch.cat([pad_gate, gate[:, :-1, :, :d]], dim=1)
        kv = torch.cat([previous_kv, kv[..., d:]], dim=2)
        gate = torch.cat([previous_gate, gate[..., d:]], dim=2)
    weights = gate.softmax(dim=2, dtype=compute_dtype(gate)).to(kv.dtype)
    return (kv * weights).sum(dim=2)


def visible_entries(n_entries: int, seq_len: int, rate: int, device) -> torch.Tensor:
    """(S, n) bool: query t sees compressed entry w once its window has closed, w < (t + 1) // rate."""
    return entries_seen(n_entries, torch.arange(seq_len, device=device), rate)


def entries_seen(n_entries: int, positions: torch.Tensor, rate: int) -> torch.Tensor:
    """(len(positions), n) bool: ``visible_entries`` of the queries at ``positions``."""
    threshold = (positions + 1) // rate
    return torch.arange(n_entries, device=positions.device)[None, :] < threshold[:, None]


class Compressor(nn.Module):
    """One compressed KV entry per ``rate`` tokens (HCA: disjoint windows; CSA: overlapping pairs), RMS-normed
    and rotated at its window's first position."""

    def __init__(self, args: DeepseekV4Args, rate: int, head_dim: int, overlap: bool):
        super().__init__()
        self.rate, self.overlap = rate, overlap
        width = 2 * head_dim if overlap else head_dim
        self.kv_proj = nn.Linear(args.dim, width, bias=False)
        self.gate_proj = nn.Linear(args.dim, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = RMSNorm(head_dim, args.norm_eps)

    def entries(self, x: torch.Tensor, freqs: torch.Tensor, seq: WholeSequence = WHOLE_SEQUENCE) -> torch.Tensor:
        """(B, N, D): the whole sequence's entries in order, from this process's rows ``x`` (B, S, dim), which
        ``seq`` says are whose (each piece starts a window: the layouts check it)."""
        b, s, _ = x.shape
        pieces = seq.pieces
        length = s // pieces
        n = length // self.rate  # closed windows per piece
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        width = kv.shape[-1]
        gate = gate.view(b, pieces, length, width)
        bias = local(self.position_bias).repeat(n, 1)
        gate = torch.cat([gate[:, :, : n * self.rate] + bias, gate[:, :, n * self.rate:]], dim=2).view(b, s, width)
        before = None
        if self.overlap:  # each piece's first entry pools the window before it too (zeros gated -inf before 0)
            before = (seq.preceding(kv, self.rate).flatten(0, 1),
                      seq.preceding(gate, self.rate, float("-inf")).flatten(0, 1))
        pooled = window_pool(kv.view(b * pieces, length, width), gate.view(b * pieces, length, width), self.rate,
                             self.overlap, before)  # (B x pieces, n, D)
        starts = seq.positions(s, x.device).view(pieces, length)[:, : n * self.rate: self.rate].flatten()
        return seq.gather(self._finish(pooled.reshape(b, pieces * n, -1), starts, freqs))

    def cached_entries(self, x: torch.Tensor, input_pos: torch.Tensor, freqs: torch.Tensor,
                       cache: CompressorCache) -> torch.Tensor:
        """Decoding: x (B, T, dim) at positions input_pos -> every entry slot of ``cache`` (B, capacity,
        head_dim), those whose window closes in x formed now; the unclosed ones are masked by the caller."""
        gate = self.gate_proj(x) + local(self.position_bias)[input_pos % self.rate]
        kv, gate, windows = cache.windows(self.kv_proj(x), gate, input_pos)
        entries = self._finish(window_pool(kv, gate, self.rate, self.overlap), windows * self.rate, freqs)
        return cache.store(entries, windows, input_pos)

    def _finish(self, pooled: torch.Tensor, starts: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """Pooled windows (B, n, head_dim) -> entries: normed, rotated at each window's first position."""
        pooled = self.kv_norm(pooled)
        cos, sin = cos_sin(freqs, starts, pooled.dtype)
        return apply_rope(pooled, cos, sin)

    def new_cache(self, batch: int, max_seq_len: int) -> CompressorCache:
        weight = self.kv_proj.weight
        return CompressorCache(batch, max_seq_len, self.rate, self.overlap, weight.shape[0],
                               self.kv_norm.weight.shape[0], weight.dtype, weight.device)


class Indexer(nn.Module):
    """Lightning indexer: its own small compressor, scored by sum_h w_h relu(q_h . k); each query keeps its
    top ``index_topk`` visible entries."""

    def __init__(self, args: DeepseekV4Args):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.compressor = Compressor(args, args.compress_rates[CSA], args.index_head_dim, overlap=True)
        self.q_b_proj = nn.Linear(args.q_lora_rank, args.index_n_heads * args.index_head_dim, bias=False)
        self.weights_proj = nn.Linear(args.dim, args.index_n_heads, bias=False)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, freqs: torch.Tensor,
                seq: WholeSequence = WHOLE_SEQUENCE, input_pos: torch.Tensor | None = None,
                cache: CompressorCache | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the entries each query keeps, the entries it sees, the scores (B, S, n) with -inf where unseen), for
        this process's queries over the whole sequence's entries. Decoding (``input_pos`` and this indexer's
        ``cache``): over every key slot of the cache, n its capacity."""
        b, s, _ = x.shape
        if cache is None:
            positions = seq.positions(s, x.device)
            keys = self.compressor.entries(x, freqs, seq)  # (B, n, d)
        else:
            positions = input_pos
            keys = self.compressor.cached_entries(x, input_pos, freqs, cache)  # (B, capacity, d)
        n = keys.shape[1]
        cos, sin = cos_sin(freqs, positions, x.dtype)
        q = apply_rope(self.q_b_proj(q_latent).view(b, s, self.n_heads, self.head_dim).transpose(1, 2), cos, sin)
        dt = compute_dtype(x)
        scores = F.relu(torch.einsum("bhsd,bnd->bshn", q.to(dt), keys.to(dt))) * self.head_dim ** -0.5
        weights = self.weights_proj(x).to(dt) * self.n_heads ** -0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=2)  # (B, S, n)
        visible = entries_seen(n, positions, self.compressor.rate)
        scores = scores.masked_fill(~visible, float("-inf"))
        chosen = scores.topk(min(self.topk, n), dim=-1).indices
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True)
        return keep & visible, visible.expand(b, -1, -1), scores


class GroupedLinear(nn.Module):
    """Block-diagonal projection: group g of the input (its heads) through its own (rank x in/g) block. Under
    tensor parallelism the weight's rows are split with the groups, and a rank projects its own groups."""

    def __init__(self, in_per_group: int, rank: int, groups: int):
        super().__init__()
        self.in_per_group, self.rank = in_per_group, rank
        self.weight = nn.Parameter(torch.empty(groups * rank, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., groups, in_per_group) -> (..., groups * rank)
        w = local(self.weight).view(-1, self.rank, self.in_per_group)
        return torch.einsum("...gi,gri->...gr", x, w).flatten(-2)


class SharedKV(nn.Module):
    """The one key-and-value head (window and compressed entries) that every query head reads: the identity.
    Under tensor parallelism a rank's heads read it, so the plan sums its gradient over the ranks."""

    def forward(self, kv: torch.Tensor) -> torch.Tensor:
        return kv


class HeadSum(nn.Module):
    """The attention's probabilities summed over its heads, (B, H, S, n) -> (B, S, n): the indexer loss's
    target. Under tensor parallelism a rank sums its heads and the plan sums the ranks'."""

    def forward(self, probs: torch.Tensor) -> torch.Tensor:
        return probs.sum(dim=1)


class Attention(nn.Module):
    def __init__(self, args: DeepseekV4Args, layer_id: int):
        super().__init__()
        self.kind = args.attention_types[layer_id]
        self.n_heads, self.head_dim, self.window = args.n_heads, args.head_dim, args.sliding_window
        self.o_groups = args.o_groups
        self.q_a_proj = nn.Linear(args.dim, args.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
        self.q_b_proj = nn.Linear(args.q_lora_rank, args.n_heads * args.head_dim, bias=False)
        self.q_b_norm = RMSNorm(args.head_dim, args.norm_eps, weighted=False)
        self.kv_proj = nn.Linear(args.dim, args.head_dim, bias=False)
        self.kv_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.o_a_proj = GroupedLinear(args.n_heads * args.head_dim // args.o_groups, args.o_lora_rank, args.o_groups)
        self.o_b_proj = nn.Linear(args.o_groups * args.o_lora_rank, args.dim, bias=False)
        self.sinks = nn.Parameter(torch.zeros(args.n_heads))
        self.shared_kv = SharedKV()
        self.compressor = None
        if self.kind != SLIDING:
            self.compressor = Compressor(args, args.compress_rates[self.kind], args.head_dim, overlap=self.kind == CSA)
        if self.kind == CSA:
            self.indexer = Indexer(args)
            self.head_sum = HeadSum()
        self.register_buffer("freqs", rope_frequencies(args, compressed=self.kind != SLIDING), persistent=False)
        self.indexer_loss_coeff = args.indexer_loss_coeff
        self.dense = False  # the indexer's warm-up: every visible entry, not the indexer's top-k
        self.indexer_loss: torch.Tensor | None = None  # this forward's, for the model to collect
        # The rows of the sequence this layer holds (context parallel: a rank's chunks, set from outside).
        self.sequence_pieces: WholeSequence = WHOLE_SEQUENCE
        self.cache: LayerCache | None = None  # set by DeepseekV4.setup_kv_cache for decoding

    def new_cache(self, batch: int, max_seq_len: int) -> LayerCache:
        """Zeroed decoding caches for ``max_seq_len`` positions (cache.py): no query head's own."""
        weight = self.kv_proj.weight
        window = WindowCache(batch, self.window, self.head_dim, weight.dtype, weight.device)
        compressor = None if self.compressor is None else self.compressor.new_cache(batch, max_seq_len)
        indexer = self.indexer.compressor.new_cache(batch, max_seq_len) if self.kind == CSA else None
        return LayerCache(window, compressor, indexer)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, S, dim): this process's rows of a sequence from position 0 (``sequence_pieces``); or, decoding
        (after ``cache`` is set), at positions ``input_pos`` (S,), every position before them given in earlier
        calls."""
        b, s, _ = x.shape
        seq = self.sequence_pieces
        pieces, length = (seq.pieces, s // seq.pieces) if input_pos is None else (1, s)
        positions = seq.positions(s, x.device) if input_pos is None else input_pos  # (S,) of this process's rows
        cos, sin = cos_sin(self.freqs, positions, x.dtype)
        q_latent = self.q_a_norm(self.q_a_proj(x))
        # -1 heads: under tensor parallelism q_b_proj holds this rank's heads
        q = self.q_b_norm(self.q_b_proj(q_latent).view(b, s, -1, self.head_dim).transpose(1, 2))
        heads = q.shape[1]
        q = apply_rope(q, cos, sin)  # (B, H, S, D)
        kv = apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)  # (B, S, D): one head, keys = values

        self.indexer_loss = None
        if input_pos is None:
            kv, allowed, visible, scores_of_indexer = self._keys(x, q_latent, kv, positions)
        else:
            (kv, allowed), scores_of_indexer = self._cached_keys(x, q_latent, kv, input_pos), None

        q = q.view(b, heads, pieces, length, self.head_dim).transpose(1, 2).flatten(0, 1)
        kv = self.shared_kv(kv)
        scores = torch.einsum("bhsd,btd->bhst", q, kv) * self.head_dim ** -0.5
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        sinks = local(self.sinks).to(scores.dtype).view(1, -1, 1, 1).expand(b * pieces, -1, length, 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]
        if scores_of_indexer is not None:  # the entries are the last keys
            on_entries = probs[..., -visible.shape[-1]:].detach()  # (B x pieces, H, length, N) -> (B, H, S, N)
            on_entries = on_entries.view(b, pieces, heads, length, -1).transpose(1, 2).reshape(b, heads, s, -1)
            self.indexer_loss = indexer_kl(self.head_sum(on_entries), scores_of_indexer, visible,
                                           self._indexer_rows(b, s))
        out = torch.einsum("bhst,btd->bshd", probs, kv).reshape(b, s, heads, self.head_dim)
        # Values carry the keys' rotation: undo it at the query's position (rotate by -angle).
        out = apply_rope(out.transpose(1, 2), cos, -sin).transpose(1, 2)
        out = self.o_a_proj(out.reshape(b, s, -1, self.o_a_proj.in_per_group))
        return self.o_b_proj(out)

    def _keys(self, x: torch.Tensor, q_latent: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor):
        """Training: (the keys (B x pieces, K, D): each piece's window rows, its own rows' kv, then the compressed
        entries; which each query sees (B x pieces, length, K); of the entries, those each query (B, S, N) attends
        or None; the indexer's scores if it trains). Each piece's queries attend its own rows and the window's
        rows just before it (held elsewhere under context parallel): pieces become batch rows."""
        b, s = kv.shape[:2]
        seq = self.sequence_pieces
        pieces, length = seq.pieces, s // seq.pieces
        reach = seq.reach(self.window - 1)
        kv = torch.cat([seq.preceding(kv, reach), kv.view(b, pieces, length, -1)], dim=2).flatten(0, 1)
        q_pos = positions.view(pieces, length)
        k_pos = torch.cat([q_pos[:, :1] - reach + torch.arange(reach, device=x.device), q_pos], dim=1)
        rel = q_pos[:, :, None] - k_pos[:, None, :]  # (pieces, length, reach + length)
        allowed = (rel >= 0) & (rel < self.window) & (k_pos[:, None, :] >= 0)
        allowed = allowed[None].expand(b, -1, -1, -1).reshape(b * pieces, length, -1)  # a view for one piece
        if self.compressor is None:
            return kv, allowed, None, None
        entries = self.compressor.entries(x, self.freqs, seq)  # (B, N, D): the whole sequence's
        visible = entries_seen(entries.shape[1], positions, self.compressor.rate).expand(b, -1, -1)
        scores_of_indexer = None
        if self.kind == CSA:  # detached inputs: only the indexer's own loss trains it
            train_indexer = bool(self.indexer_loss_coeff) and torch.is_grad_enabled()
            # Without its loss the indexer gets no gradient: no graph (its scores' would live to the end).
            with contextlib.nullcontext() if train_indexer else torch.no_grad():
                keep, visible, scores_of_indexer = self.indexer(x.detach(), q_latent.detach(), self.freqs, seq)
            scores_of_indexer = scores_of_indexer if train_indexer else None
            visible = visible if self.dense else keep
        kv = torch.cat([kv, entries[:, None].expand(-1, pieces, -1, -1).flatten(0, 1)], dim=1)
        allowed = torch.cat([allowed, visible.reshape(b * pieces, length, -1)], dim=-1)
        return kv, allowed, visible, scores_of_indexer

    def _cached_keys(self, x: torch.Tensor, q_latent: torch.Tensor, kv: torch.Tensor, input_pos: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoding: (the keys the queries may see (B, K, D): the window's ring, these positions' kv, then every
        compressed entry slot; which each query sees (B, S, K)), the caches updated with x."""
        b, s = kv.shape[:2]
        keys, allowed = self.cache.window.update(kv, input_pos)
        allowed = allowed.expand(b, s, -1)
        if self.compressor is None:
            return keys, allowed
        entries = self.compressor.cached_entries(x, input_pos, self.freqs, self.cache.compressor)
        visible = entries_seen(entries.shape[1], input_pos, self.compressor.rate).expand(b, -1, -1)
        if self.kind == CSA and not self.dense:
            visible = self.indexer(x, q_latent, self.freqs, input_pos=input_pos, cache=self.cache.indexer)[0]
        elif self.kind == CSA:  # the indexer's keys still follow the tokens
            self.indexer.compressor.cached_entries(x, input_pos, self.freqs, self.cache.indexer)
        return torch.cat([keys, entries], dim=1), torch.cat([allowed, visible], dim=-1)

    def _indexer_rows(self, batch: int, length: int) -> float | None:
        """Under context parallel, the indexer loss's divisor on this rank: the whole sequence's queries that
        see an entry / the ranks (each rank's sum / this, averaged over the ranks as the gradients are, is one
        process's mean); None in one process (the mean of this call's rows)."""
        seq = self.sequence_pieces
        if seq.ranks == 1:
            return None
        total, rate = seq.total_length(length), self.compressor.rate
        seen = max(total - rate + 1, 0)  # positions p >= rate - 1: their first window has closed
        return batch * seen / seq.ranks

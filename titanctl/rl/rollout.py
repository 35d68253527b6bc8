"""Sampling completions with the policy itself: every prompt's group in one batch, over a static KV cache.

The sampler is the training model, in the same process and with the same parameters (no copy): each row
of the batch is one completion, its prompt at positions 0..P-1 of its own row of the KV cache (prompts
of any lengths share the batch; no row's positions depend on another's), its tokens decoded one step at
a time at positions P, P + 1, ... The KV cache has ``key_length`` positions (training.seq_len), allocated
once per run and written at each row's positions, so every decode step is the same computation; with
``compile`` that step (one token of every row and the choice of the next) is compiled once.

A token is drawn from the tempered softmax of the decode step's logits with the Gumbel-max trick: the
noise of vocabulary entry j for row r at position p is a hash of (the row's key, p, j) computed with
tensor ops (``titanctl.inference.sampling``'s mix), so a completion depends only on the run's seed, the step,
the prompt's place in the step's batch and its index in the group, never on which rank samples it, on
the batch around it or on a resume. The logprob returned with each token is log-softmax of those same
logits (tempered) at the token: what the trainer must reproduce (``logprob_diff_max``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from titanctl.inference.sampling import mix32, row_uniform, seed_key


class RowCache:
    """One layer's keys and values, (B, H_kv, L, head_dim), each row at its own positions: the interface of
    ``titanctl.models.common.attention.KVCache`` with positions (B, T) instead of (T,)."""

    def __init__(self, batch: int, length: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        shape = (batch, kv_heads, length, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.positions = torch.arange(length, device=device)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, T, head_dim) at each row's positions input_pos (B, T); the whole cache."""
        index = input_pos[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.k.scatter_(2, index, k)
        self.v.scatter_(2, index, v)
        return self.k, self.v

    def mask(self, input_pos: torch.Tensor, window: int = 0) -> torch.Tensor:
        """(B, 1, T, L): row b's query at position p sees its keys at positions <= p (within ``window``)."""
        query = input_pos[:, None, :, None]
        seen = self.positions <= query
        if window:
            seen = seen & (self.positions > query - window)
        return seen

    def clear(self) -> None:
        self.k.zero_()
        self.v.zero_()


@dataclass
class Rollout:
    """Completions of one batch of prompts: row r is prompt ``prompt_lengths[r]`` tokens long, then
    ``response_lengths[r]`` sampled tokens (a final stop token included), then padding."""

    tokens: torch.Tensor  # (B, P_max + R) int64: prompt, response, padding
    prompt_lengths: torch.Tensor  # (B,) int64
    response_lengths: torch.Tensor  # (B,) int64, 1..R
    logprobs: torch.Tensor  # (B, R) fp32: each sampled token's logprob under the logits it was drawn from; 0 after
    stopped: torch.Tensor  # (B,) bool: ended with a stop token (else cut at R tokens)
    seconds: float
    routes: dict[int, torch.Tensor] | None = None  # MoE layer -> (B, L, k) expert ids of each input position

    def response(self, row: int) -> list[int]:
        start = int(self.prompt_lengths[row])
        return self.tokens[row, start:start + int(self.response_lengths[row])].tolist()

    @property
    def generated_tokens(self) -> int:
        return int(self.response_lengths.sum())


def row_keys(seed: int, step: int, ids: Sequence[int], group_size: int) -> torch.Tensor:
    """(len(ids) * group_size,) int64 noise keys: completion g of the prompt with place ``ids[i]`` in step
    ``step``'s batch, a function of (seed, step, place, g) only."""
    base = seed_key(seed)
    keys = [mix32(mix32(mix32(base ^ seed_key(step)) ^ seed_key(i)) ^ g) for i in ids for g in range(group_size)]
    return torch.tensor(keys, dtype=torch.int64)


def gumbel(keys: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
    """(B, n) fp32 Gumbel noise for rows with ``keys`` (B,) at ``positions`` (B,): a function of both only."""
    return -torch.log(-torch.log(row_uniform(keys, positions, n)))


@contextmanager
def logits_at(model: nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """Inside, ``model`` computes logits at ``positions`` (B, N) of each row only, (B, N, vocab): its final
    norm's output is cut to them before the output layer (the other positions' logits are never used)."""

    def keep(module, args, out: torch.Tensor) -> torch.Tensor:
        return out.gather(1, positions[..., None].expand(-1, -1, out.shape[-1]))

    hook = model.norm.register_forward_hook(keep)
    try:
        yield
    finally:
        hook.remove()


def choose(logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, temperature: float,
           vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token (B,), its logprob (B,)) drawn from softmax(logits[:, :vocab] / temperature)."""
    scores = logits[:, :vocab].float() / temperature
    token = (scores + gumbel(keys, positions, scores.shape[-1])).argmax(-1)
    return token, token_logprobs(scores, token)


def token_logprobs(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(scores)[..., token]: the sampler's and the trainer's logprob, the same function."""
    return torch.log_softmax(scores, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class RouteRecorder:
    """MoE routing replay: while recording, each router's chosen expert ids are kept at their rows'
    positions; while replaying, the router takes them instead of its own top-k (its weights still come
    from its live scores). Set as ``Router.route_override`` on every MoE layer."""

    def __init__(self, model: nn.Module, batch: int, length: int):
        self.routers = {int(i): block.moe.router for i, block in model.layers.items() if block.moe is not None}
        top_k = next(iter(self.routers.values())).moe.top_k
        self.routes = {i: torch.zeros(batch, length, top_k, dtype=torch.int64) for i in self.routers}
        self.positions: torch.Tensor | None = None  # (B, T) of the forward being recorded
        self.replaying: dict[int, torch.Tensor] | None = None  # layer -> (N, k) ids for the next forward
        for i, router in self.routers.items():
            router.route_override = self._override(i)

    def _override(self, layer: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def override(experts: torch.Tensor) -> torch.Tensor:
            if self.replaying is not None:
                return self.replaying[layer].to(experts.device)
            if self.positions is not None:
                rows = torch.arange(self.positions.shape[0])[:, None].expand_as(self.positions)
                self.routes[layer][rows, self.positions.cpu()] = experts.view(*self.positions.shape, -1).cpu()
            return experts
        return override

    def replay(self, routes: dict[int, torch.Tensor] | None):
        """Inside: forwards route by ``routes`` (layer -> (N, k)); None: by their own choice."""
        recorder = self

        class _Replay:
            def __enter__(self):
                recorder.replaying = routes

            def __exit__(self, *exc):
                recorder.replaying = None

        return _Replay() if routes is not None else nullcontext()

    def close(self) -> None:
        for router in self.routers.values():
            router.route_override = None


class Sampler:
    """Samples completions with ``model`` (the policy) over a KV cache of ``key_length`` positions for
    ``batch`` rows; ``forward_context()`` wraps every forward (autocast, the batch-invariant kernels).
    ``finished(done)``: whether decoding may stop, given which rows are done (default: all of this rank's;
    under expert parallelism all ranks', whose decode steps exchange tokens); ``tp``: the tensor-parallel
    degree, which splits the key/value heads (the policy's TP plan keeps a decode step's activations whole)."""

    def __init__(self, model: nn.Module, *, batch: int, key_length: int, stop_tokens: Sequence[int], vocab: int,
                 temperature: float, pad_id: int, forward_context: Callable = nullcontext, compile: bool = False,
                 record_routes: bool = False, finished: Callable[[torch.Tensor], bool] | None = None,
                 dtype: torch.dtype = torch.float32, tp: int = 1):
        self.model, self.batch, self.key_length = model, batch, key_length
        self.device = model.rope_cache.device
        self.stops = torch.tensor(sorted(set(stop_tokens)), dtype=torch.long, device=self.device)
        self.vocab, self.temperature, self.pad_id = vocab, temperature, pad_id
        self.forward_context = forward_context
        self.finished = finished or (lambda done: bool(done.all()))
        # This rank's key/value heads (tensor parallelism splits them ``tp`` ways), in the dtype a forward
        # computes in (FSDP's mixed-precision parameters, autocast).
        self.caches = [RowCache(batch, key_length, model.args.kv_heads // tp, model.args.head_dim, dtype, self.device)
                       for _ in model.layers]
        self.recorder = RouteRecorder(model, batch, key_length) if record_routes else None
        self._step = torch.compile(self._decode_step, fullgraph=True, dynamic=False) if compile else self._decode_step

    def _attach(self, attach: bool) -> None:
        for layer, cache in zip(self.model.layers.values(), self.caches):
            layer.attention.cache = cache if attach else None

    def _decode_step(self, token: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor):
        """Every row's token (B,) at its position (B,) -> the next token (B,) and its logprob (B,)."""
        logits = self.model(token[:, None], input_pos=positions[:, None])[:, -1]  # (B, vocab)
        return choose(logits, keys, positions + 1, self.temperature, self.vocab)

    @torch.no_grad()
    def sample(self, prompts: Sequence[Sequence[int]], keys: torch.Tensor, max_new_tokens: int) -> Rollout:
        """Complete every prompt (one row each, ``keys`` (B,) its noise) by up to ``max_new_tokens`` tokens."""
        if len(prompts) != self.batch:
            raise ValueError(f"{len(prompts)} prompts for a sampler of {self.batch} rows")
        device = self.device
        start = time.perf_counter()
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
        longest = int(lengths.max())
        if longest + max_new_tokens > self.key_length:
            raise ValueError(f"{longest} prompt + {max_new_tokens} new tokens exceed the {self.key_length}-position "
                             "cache")
        tokens = torch.full((self.batch, longest + max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        keys = keys.to(device)
        logprobs = torch.zeros(self.batch, max_new_tokens, device=device)
        done = torch.zeros(self.batch, dtype=torch.bool, device=device)
        response_lengths = torch.full((self.batch,), max_new_tokens, dtype=torch.long, device=device)
        rows = torch.arange(self.batch, device=device)
        for cache in self.caches:
            cache.clear()
        self._attach(True)
        try:
            with self.forward_context():
                positions = torch.arange(longest, device=device).expand(self.batch, -1)
                if self.recorder is not None:
                    self.recorder.positions = positions
                with logits_at(self.model, (lengths - 1)[:, None]):
                    logits = self.model(tokens[:, :longest], input_pos=positions)[:, 0]  # (B, vocab)
                token, logprob = choose(logits, keys, lengths, self.temperature, self.vocab)
                for s in range(max_new_tokens):
                    position = lengths + s  # where each row's new token sits
                    token = torch.where(done, self.pad_id, token)
                    tokens[rows, position] = token
                    logprobs[:, s] = torch.where(done, 0.0, logprob)
                    ended = ~done & torch.isin(token, self.stops)
                    response_lengths = torch.where(ended, s + 1, response_lengths)
                    done = done | ended
                    if s + 1 == max_new_tokens or self.finished(done):
                        break
                    if self.recorder is not None:
                        self.recorder.positions = position[:, None]
                    token, logprob = self._step(token, position, keys)
        finally:
            self._attach(False)
            if self.recorder is not None:
                self.recorder.positions = None
        routes = None
        if self.recorder is not None:
            routes = {i: r.clone() for i, r in self.recorder.routes.items()}
        return Rollout(tokens, lengths, response_lengths, logprobs, done, time.perf_counter() - start, routes)

    def close(self) -> None:
        self._attach(False)
        if self.recorder is not None:
            self.recorder.close()

"""Text generation with a static KV cache, in one process or tensor parallel over all ranks.

Checkpoints (:func:`find_checkpoint`, :func:`load_weights`, from ``titanctl.checkpoint.weights``):
every format ``titanctl convert`` reads (titanctl DCP, Hugging Face, Meta, torchtune, torchtitan),
a checkpoint folder or a folder of step-N folders (the newest complete one is taken); the model,
its family included, comes from the checkpoint (``titanctl.json``, ``config.json``, ``params.json``),
else from ``--config`` or the tensor shapes. The tokenizer is the recipe's when it names one
(``--config``, ``--model.tokenizer_path``), else the one in the checkpoint folder (``tokenizer.json``
with its ``tokenizer_config.json``, or ``tokenizer.model``), else the bundled one. A model may have
more embedding rows than the tokenizer has ids (Qwen3 pads 151669 ids to 151936 rows): those ids
are never sampled. :func:`load_model` builds the model,
sharded for tensor parallel when given a mesh (``titanctl.inference.tensor_parallel``: plain local
tensors, the partial outputs of ``wo`` and ``w2`` summed over the ranks, the logits gathered), and fills it.

Decoding (:class:`Decoder`): the prompt in one forward (prefill, eager; only the last position's
logits are computed), then one token per step. The KV cache is allocated once for prompt + new
tokens and written at a position tensor, so the decode step (one token's forward and the choice of
the next, ``titanctl.inference.sampling``) is the same computation at every position: ``torch.compile``
compiles it once, after the prefill (the first token never waits for the compiler). Tokens stay
tensors; the host reads them only every ``stop_check_interval`` tokens, to see whether a stop token
came. On a CPU the decoder can choose its thread count by measuring (``threads``): the prompt's
first chunks run one per candidate count, the rest of the work at the fastest.

:func:`run` is what ``titanctl infer-tp`` does: start the process group, load, generate, decode.
"""

from __future__ import annotations

import os
import secrets
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from titanctl.checkpoint.weights import (
    CheckpointSource,
    checkpoint_tokenizer,
    find_checkpoint,
    load_weights,
    with_model,
)
from titanctl.config.recipe import load_config, parse_overrides
from titanctl.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from titanctl.errors import ConfigError, DataError, ParallelError
from titanctl.host_memory import available_bytes
from titanctl.inference import tensor_parallel as inference_tp
from titanctl.inference.chat_prompt import chat_messages, chat_prompt
from titanctl.inference.sampling import Sampling, sample, seed_key
from titanctl.models import registry
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.attention import StaticCache
from titanctl.models.registry import model_args_from_config, spec_of
from titanctl.parallel.runtime import elastic
from titanctl.parallel.runtime.env import init_process
from titanctl.parallel.runtime.peers import connecting, peer_failures_named

GREEDY = Sampling()

__all__ = [
    "CheckpointSource", "Decoder", "Generation", "RunReport", "build_model", "cache_length", "check_tp_degree",
    "check_vocab", "find_checkpoint", "generate", "load_model", "load_weights", "run",
]


# ------------------------------------------------------------------------------ checks and loading


def check_tp_degree(args: ModelArgs, tp: int) -> None:
    """Fail before any collective if the family has no tensor-parallel plan, or what its plan splits (attention
    heads, Gated DeltaNet key heads) cannot be split ``tp`` ways."""
    why = spec_of(args).layouts_not_built.get("tp")
    if tp > 1 and why:
        raise ParallelError(f"{args.family} has no tensor parallel inference yet ({why}): run infer-tp as one "
                            f"process, not {tp}")
    split_sizes = spec_of(args).tp_plan.split_sizes  # what a family's own plan splits (DeepSeek-V4: not KV heads)
    if split_sizes is not None:
        sizes = [(what.removeprefix("model "), size) for what, size in split_sizes(args)]
    else:
        sizes = [("n_heads", args.n_heads), ("n_kv_heads", args.kv_heads)]
        if args.linear_attention is not None:
            sizes.append(("linear_attention.num_key_heads", args.linear_attention.num_key_heads))
    for what, size in sizes:
        if size % tp:
            raise ParallelError(
                f"model {what} = {size} is not divisible by the {tp} processes of tensor parallel inference: "
                f"run with a process count that divides {' and '.join(str(n) for _, n in sizes)}"
            )


def check_vocab(args: ModelArgs, vocab_size: int, tokenizer_path: Path, *, exact: bool = False) -> None:
    """The tokenizer's ids must all have an embedding row; the model may have more rows (padding,
    as Qwen3's), never sampled. ``exact``: the tokenizer is a guess (the bundled one, which nobody
    named), so it must fit the model exactly."""
    if vocab_size > args.vocab_size or (exact and vocab_size != args.vocab_size):
        raise DataError(
            f"the model has a vocabulary of {args.vocab_size} tokens but tokenizer {tokenizer_path} has "
            f"{vocab_size}: give the checkpoint's tokenizer with --config (model.tokenizer_path)"
        )


def check_model_overrides(overrides: Sequence[str], source: CheckpointSource) -> None:
    """The model of a checkpoint that declares one is that model: an override of it is refused
    rather than ignored (only model.tokenizer_path, which the checkpoint does not decide, is read)."""
    if source.args is None:
        return
    for key, _ in parse_overrides(list(overrides)):
        if (key.startswith("model.") and key != "model.tokenizer_path") or key == "training.seq_len":
            raise ConfigError(
                f"--{key} is not read by infer-tp for {source.folder}: its model comes from {source.origin} "
                "(the cache length is the prompt plus --max-new-tokens)"
            )


def eager_part(model: nn.Module) -> str | None:
    """Why ``model``'s decode step cannot compile as one graph: the reason a module gives for running eagerly
    between graphs (``eager_in_compiled_graphs``: e.g. MoE routing, whose sizes depend on the data); None if
    nothing does."""
    for module in model.modules():
        why = getattr(module, "eager_in_compiled_graphs", None)
        if why:
            return why
    return None


def model_device(model: nn.Module) -> torch.device:
    """Where ``model``'s weights are (and so its caches and inputs)."""
    return next(model.parameters()).device


def build_model(args: ModelArgs, device: torch.device, tp_mesh=None) -> nn.Module:
    """An uninitialized model on ``device``; over ``tp_mesh`` its split weights are DTensors for
    the checkpoint reader to fill (then :func:`titanctl.inference.tensor_parallel.localize`)."""
    with torch.device("meta"):
        model = registry.build_model(args)
    if tp_mesh is not None:
        inference_tp.shard_weights(model, tp_mesh)
    model.to_empty(device=device)
    model.init_buffers(device)
    return model.eval().requires_grad_(False)


def load_model(source: CheckpointSource, args: ModelArgs, device: torch.device, tp_mesh=None) -> nn.Module:
    """The checkpoint's model, ready to decode: one process, or this rank's part of it under TP."""
    model = build_model(args, device, tp_mesh)
    load_weights(model, source)
    if tp_mesh is not None:
        inference_tp.localize(model, tp_mesh)
    use_decode_layout(model)
    return model


@torch.no_grad()
def use_decode_layout(model: nn.Module) -> None:
    """On a CPU, store every linear's weight transposed in memory (same shape and values).

    Decoding multiplies one row by each weight; ``F.linear`` then computes ``x @ W.T``, which
    BLAS streams faster when ``W.T`` is the contiguous one (measured on the debug model, eager
    and compiled). Numerics change only in rounding.
    """
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.device.type == "cpu":
            module.weight.data = module.weight.data.t().contiguous().t()


# ------------------------------------------------------------------------------ decoding


@dataclass
class Generation:
    prompt_tokens: list[int]
    tokens: list[int]  # generated ids, a final stop token included
    prefill_seconds: float  # prompt forward + first token
    decode_seconds: float  # the other tokens
    stop_reason: str  # "stop_token" or "max_new_tokens"
    compile_seconds: float = 0.0  # compiling the decode step (0 when eager or compiled before); in neither rate
    threads: dict[str, int] | None = None  # {"prefill": n, "decode": m}: the thread counts used (CPU)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / max(self.prefill_seconds + self.decode_seconds, 1e-9)

    @property
    def prefill_tokens_per_second(self) -> float:
        return len(self.prompt_tokens) / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_second(self) -> float | None:
        return (len(self.tokens) - 1) / self.decode_seconds if len(self.tokens) > 1 and self.decode_seconds else None


# Kernel choices of the decode step on CPU, per ISA (torch.backends.cpu.get_cpu_capability()),
# measured with benchmarks/generate_throughput.py --isa both --kernels --threads 1 (debug model,
# fp32, prompt 64 + 160 new tokens; an AVX-512 EPYC, and the same machine on torch's and oneDNN's
# AVX2 code paths) and, for long caches, prompt 1024 + 160 (decode tokens/s, busy shared machine):
# - attention of the compiled step. AVX-512: the plain math formulation, which inductor fuses with
#   the surrounding ops: 435 / 393 / 505 / 175 (cache 1280) tokens/s against 407 / 383 / 433 / 156
#   with the fused CPU flash kernel. AVX2: a tie, so torch's own choice (that kernel; no context
#   manager around the step): 451 / 358 / 267 / 201 against math's 463 / 341 / 277 / 194. Eager
#   steps and the prefill keep the fused kernel everywhere (eager math: 219 against 259 on
#   AVX-512, 159 against 167 on AVX2).
# - linears: torch's own (MKL) on every ISA; oneDNN's (what training uses, parallel.converters.
#   onednn_linear) decoded at 219 / 198 against 435 / 393 (AVX-512) and 259 / 220 against 451 / 341
#   (AVX2): one row times a weight takes 4-20 us in MKL against 34-51 us in oneDNN's linear, on both.
# - threads: not a per-ISA constant. On a 2-core machine any other running process made a second
#   thread a loss (a 2-thread eager prefill ran at 2% of the 1-thread one at load average 1.5-1.9 on
#   AVX-512, and at 2% or 78% on AVX2), so infer-tp offers the thread counts the load leaves room
#   for (:func:`thread_candidates`) and the decoder measures them on the real work.
COMPILED_ATTENTION: dict[str, SDPBackend | None] = {"avx512": SDPBackend.MATH, "avx2": None}
PROBE_ROUNDS = 3  # decode-step probe: rounds of PROBE_STEPS steps at each candidate thread count
PROBE_STEPS = 2
PREFILL_PROBE_TOKENS = 64  # at most this many prompt tokens per candidate in the prefill's probe
# Queries x keys of one prefill forward, at most: a longer prompt is run in chunks (each attends to the
# positions up to its end only, so the work is the same) to bound attention's mask, queries x keys
# (one byte each, and four in torch's kernels beside it): one forward of a 43k-token prompt held
# ~1.9 GB of mask per layer. Prompts up to ~11k tokens still run in one forward: the chunks' masks cost
# time (debug model, 8k tokens in chunks of 1024: 1.27x the CPU time of one forward).
PREFILL_MASK_ELEMENTS = 2**27
PREFILL_PROGRESS_SECONDS = 10.0


def compiled_attention(device: torch.device) -> SDPBackend | None:
    """The attention backend of the compiled decode step on this device (None: torch's choice,
    also on a CPU capability not measured)."""
    if device.type != "cpu":
        return None
    capability = torch.backends.cpu.get_cpu_capability().lower()
    return COMPILED_ATTENTION.get("avx512" if capability.startswith("avx512") else capability)


class Decoder:
    """A model with its KV cache allocated for ``max_seq_len`` positions and its decode step
    compiled (``compile=True``) or eager; generate with it as often as needed, then :meth:`close`.

    The cache is never cleared between generations: a step writes its position before attending,
    and attends only to positions up to its own, all written by the current generation.

    ``threads``: candidate thread counts (CPU). With more than one, each generation measures them
    on its own work (nothing is computed twice): the prefill's first chunks, one per candidate, and
    the rest of the prompt at the fastest; a compiled decode step runs at that count too (it is
    compiled for one), eager decode steps measure the candidates again on their first steps. Empty:
    torch's current setting; one count: that count.
    ``attention``: force the compiled step's attention backend (default: :data:`COMPILED_ATTENTION`).
    """

    def __init__(self, model: nn.Module, max_seq_len: int, *, compile: bool = False, stop_check_interval: int = 8,
                 threads: Sequence[int] = (), attention: SDPBackend | None = None):
        if stop_check_interval < 1:
            raise ValueError("stop_check_interval must be at least 1")
        if any(n < 1 for n in threads):
            raise ValueError("thread counts must be at least 1")
        if compile and (why := eager_part(model)):
            raise ValueError(f"this model's decode step cannot compile as one graph ({why}): decode with compile=False")
        self.model = model
        self.max_seq_len = max_seq_len
        self.stop_check_interval = stop_check_interval
        self.device = model_device(model)
        self.threads = list(dict.fromkeys(threads)) if self.device.type == "cpu" else []
        model.setup_kv_cache(max_seq_len)
        self.compiled = compile
        self._step = self._decode_step
        # The backend is set around the compiled step's calls, not inside it: a context manager
        # traced into the graph makes AOTAutograd skip its on-disk cache (a warm compile then
        # traces everything again: 2x its time). A forced backend goes inside (its own graph and
        # cache entry: the cache does not tell backends apart when the graphs are the same).
        self._attention = attention
        self._backend = (attention or compiled_attention(self.device)) if compile else None
        if compile:
            self._step = torch.compile(self._decode_step if attention is None else self._decode_step_with_backend,
                                       fullgraph=True, dynamic=False, options=_compile_options(model))
        self._warm: set[Sampling] = set()

    def close(self) -> None:
        self.model.clear_kv_cache()

    def _same_inputs(self):
        """Later steps of one generation: the inputs keep their shapes, the model and sampling stay,
        so the compiled step's guards (checks of the whole module tree, a visible share of a small
        model's step) are skipped; those that tell one compiled graph from another still run. The
        stance is process-wide while the loop runs."""
        if self.compiled:
            return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        return nullcontext()

    def _compiled_backend(self):
        """The attention backend around compiled steps (eager steps keep torch's fused kernel)."""
        return sdpa_kernel(self._backend) if self._backend is not None and self._attention is None else nullcontext()

    def _decode_step(self, token: torch.Tensor, pos: torch.Tensor, sampling: Sampling, key: torch.Tensor):
        """token (1, 1) at position pos (1,) -> the next token (1, 1)."""
        logits = self.model(token, input_pos=pos)[:, -1]  # (1, vocab)
        return sample(logits, sampling, key, pos + 1)

    def _decode_step_with_backend(self, token, pos, sampling, key):
        with sdpa_kernel(self._attention):
            return self._decode_step(token, pos, sampling, key)

    def warm_up(self, sampling: Sampling) -> float:
        """Compile the decode step for ``sampling`` now; the seconds it took (0 if eager or done).

        The step runs at the cache's last position, which no generation reads before writing it
        (a step attends to the positions up to its own; the last is never fed back), so this may
        happen between a prefill and its decoding."""
        if not self.compiled or sampling in self._warm:
            return 0.0
        start = time.perf_counter()
        with torch.no_grad(), self._compiled_backend():
            token = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            pos = torch.tensor([self.max_seq_len - 1], device=self.device)
            self._step(token, pos, sampling, torch.tensor(0, device=self.device))
        self._warm.add(sampling)
        return time.perf_counter() - start

    @torch.no_grad()
    def generate(
        self, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling = GREEDY, *, seed: int = 0,
        stop_tokens: Iterable[int] = (), on_first_token: Callable[[int], None] | None = None,
        say: Callable[[str], None] | None = None,
    ) -> Generation:
        """Continue ``prompt`` by up to ``max_new_tokens`` tokens (batch of one).

        ``on_first_token(id)`` is called as soon as the prefill chose it (before any compiling);
        ``say(text)`` hears what a phase that may take seconds is about to do."""
        if not prompt:
            raise ValueError("the prompt needs at least one token")
        if len(prompt) + max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"{len(prompt)} prompt + {max_new_tokens} new tokens exceed the {self.max_seq_len}-position KV cache"
            )
        device = self.device
        key = torch.tensor(seed_key(seed), device=device)
        stops = torch.tensor(sorted(set(stop_tokens)), dtype=torch.long, device=device)
        threads_before = torch.get_num_threads()
        try:
            start = time.perf_counter()
            token, prefill_threads = self._prefill(list(prompt), sampling, key, say)  # (1, 1)
            chosen = [token]
            stopped = _has_stop(chosen, stops)
            prefill_seconds = time.perf_counter() - start
            if on_first_token is not None:
                on_first_token(int(token))
            compile_seconds = 0.0
            if not stopped and max_new_tokens > 1 and self.compiled and sampling not in self._warm:
                if say is not None:
                    say(f"compiling the decode step (a {self.max_seq_len}-position cache; inductor's cache makes "
                        "the next runs of this model and cache size faster)...")
                compile_seconds = self.warm_up(sampling)
            if say is not None and not stopped and max_new_tokens > 1:
                say(f"decoding up to {max_new_tokens - 1} more tokens ({'compiled' if self.compiled else 'eager'} "
                    "decode step)...")
            with self._compiled_backend():
                decode_start = time.perf_counter()
                tokens, decode_threads = self._decode(chosen, stopped, stops, len(prompt), max_new_tokens, sampling,
                                                      key)
                decode_seconds = time.perf_counter() - decode_start
        finally:
            torch.set_num_threads(threads_before)
        tokens, reason = _cut_at_stop(torch.cat(tokens).flatten().tolist(), set(stop_tokens))
        threads = {"prefill": prefill_threads, "decode": decode_threads} if device.type == "cpu" else None
        return Generation(list(prompt), tokens, prefill_seconds, decode_seconds, reason, compile_seconds, threads)

    def _forward_last(self, ids: list[int], first: int) -> torch.Tensor:
        """Logits (1, vocab) of the last of ``ids``, which sit at positions ``first``... in the cache.

        Only that position goes through the output layer (the others' logits are never used), and
        attention reads only the cache's positions up to the last of ``ids`` (:class:`_CachePrefix`)."""
        positions = torch.arange(first, first + len(ids), device=self.device)
        norm = getattr(self.model, "norm", None)
        hook = norm.register_forward_hook(_keep_last_position) if isinstance(norm, nn.Module) else None
        try:
            with _cache_prefix(self.model, first + len(ids), causal=first == 0):
                return self.model(torch.tensor([ids], device=self.device), input_pos=positions)[:, -1]
        finally:
            if hook is not None:
                hook.remove()

    def _prefill(self, prompt: list[int], sampling: Sampling, key: torch.Tensor,
                 say: Callable[[str], None] | None = None) -> tuple[torch.Tensor, int]:
        """The first token (1, 1) and the thread count the prompt's forward ended with.

        With several candidate thread counts, the prompt's first chunks (equal sizes, each the
        same work: every position attends over the whole cache, masked) run one per candidate,
        and the rest at the fastest. A prefill in chunks that takes long says how far it is, every
        PREFILL_PROGRESS_SECONDS, with the time left at its pace (a 43k-token prompt takes minutes on a CPU)."""
        start = last_said = time.perf_counter()
        done, seconds = 0, {}
        if len(self.threads) > 1 and len(prompt) >= 2 * len(self.threads):
            chunk = min(PREFILL_PROBE_TOKENS, len(prompt) // (2 * len(self.threads)) or 1)
            for count in self.threads:
                torch.set_num_threads(count)
                begin = time.perf_counter()
                logits = self._forward_last(prompt[done:done + chunk], done)
                seconds[count] = time.perf_counter() - begin
                done += chunk
            torch.set_num_threads(min(seconds, key=seconds.get))
        elif self.threads:
            torch.set_num_threads(self.threads[0])
        per_forward = max(CACHE_BUCKET, PREFILL_MASK_ELEMENTS // self.max_seq_len)
        while done < len(prompt):
            chunk = prompt[done:done + per_forward]
            logits = self._forward_last(chunk, done)
            done += len(chunk)
            now = time.perf_counter()
            if say is not None and done < len(prompt) and now - last_said >= PREFILL_PROGRESS_SECONDS:
                # Later chunks attend over more keys: the pace so far understates what is left.
                left = (now - start) / done * (len(prompt) - done)
                say(f"prefill: {done:,} of {len(prompt):,} prompt tokens in {now - start:.0f} s, at least "
                    f"{left:.0f} s left")
                last_said = now
        return sample(logits, sampling, key, torch.tensor([len(prompt)], device=self.device)), torch.get_num_threads()

    def _decode(self, chosen: list[torch.Tensor], stopped: bool, stops: torch.Tensor, prompt_len: int,
                max_new_tokens: int, sampling: Sampling, key: torch.Tensor) -> tuple[list[torch.Tensor], int]:
        """Decode after the first token; returns (every token, the thread count decoding ended with).

        Eager, with several candidate thread counts and enough tokens to go, the first steps run in
        rounds of PROBE_STEPS at each candidate; the rest at the one with the least median step time.
        A compiled step keeps the count it was compiled at (the prefill's choice): torch.compile's
        guards include the thread count, another one would compile the step again."""
        token, pos = chosen[-1], torch.tensor([prompt_len], device=self.device)
        checked = 1
        schedule: list[int] = []
        if (not self.compiled and len(self.threads) > 1
                and max_new_tokens - 2 >= 4 * PROBE_ROUNDS * PROBE_STEPS * len(self.threads)):
            schedule = [n for _ in range(PROBE_ROUNDS) for n in self.threads for _ in range(PROBE_STEPS)]
        times: dict[int, list[float]] = {n: [] for n in self.threads}

        def advance() -> None:
            nonlocal token, stopped, checked
            token = self._step(token, pos, sampling, key)
            chosen.append(token)
            pos.add_(1)
            if len(chosen) - checked >= self.stop_check_interval or len(chosen) == max_new_tokens:
                stopped, checked = _has_stop(chosen[checked:], stops), len(chosen)

        if not stopped and len(chosen) < max_new_tokens:
            advance()  # every guard checked: recompiles if the model or the kind of input changed
        with self._same_inputs():
            for count in schedule:
                if stopped or len(chosen) >= max_new_tokens:
                    break
                torch.set_num_threads(count)
                begin = time.perf_counter()
                advance()
                times[count].append(time.perf_counter() - begin)
            medians = {n: statistics.median(t) for n, t in times.items() if t}
            if medians:
                torch.set_num_threads(min(medians, key=medians.get))
            while not stopped and len(chosen) < max_new_tokens:
                advance()
        return chosen, torch.get_num_threads()


def _keep_last_position(module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    return output[:, -1:]  # (B, 1, dim): the output layer then computes one position's logits


class _CachePrefix(nn.Module):
    """The first ``length`` positions of a :class:`StaticCache` (views: writes land in the cache), with
    its interface, for a prefill that reaches no further: attention then reads ``length`` keys, not
    the whole cache (a 1024-token prompt in a 1280-position cache: 1024 x 1024 scores, not 1024 x
    1280; a latent cache expands only ``length`` positions). With ``causal`` (the queries are positions
    0..length-1) its mask is exactly the causal one, and :class:`_CausalMask` lets the attention kernel
    skip the masked half instead of reading the mask (measured, 1024 tokens: 4,445 prompt tokens/s of
    thread time against 3,015 over the whole cache; transformers' causal prefill 4,504)."""

    def __init__(self, cache: StaticCache, length: int, masks: list[torch.Tensor] | None):
        super().__init__()
        self.position_dims = cache.position_dims
        for name, dim in self.position_dims.items():  # e.g. k, v: (B, H_kv, length, head_dim)
            setattr(self, name, getattr(cache, name).narrow(dim, 0, length))
        self.positions = cache.positions[:length]
        self.masks = masks

    update = StaticCache.update

    def mask(self, input_pos: torch.Tensor, window: int = 0) -> torch.Tensor:
        return _prefix_mask(self.positions, input_pos, self.masks, window)


def _prefix_mask(
    positions: torch.Tensor, input_pos: torch.Tensor, masks: list[torch.Tensor] | None, window: int = 0
) -> torch.Tensor:
    """(T, length): the query at position p sees the keys at positions <= p (and > p - ``window`` in a
    sliding-window layer, whose mask is its own). Under ``masks`` (a causal prefill) one mask serves every
    full-attention layer: the queries are the same, and each kept mask costs T x T bytes."""
    if window:
        return (positions[None, :] <= input_pos[:, None]) & (positions[None, :] > input_pos[:, None] - window)
    if masks:
        return masks[0]
    mask = positions[None, :] <= input_pos[:, None]
    if masks is not None:
        masks.append(mask)
    return mask


class _CausalMask(TorchFunctionMode):
    """Scaled dot-product attention under one of ``masks`` (each known to be the causal mask of a
    square score matrix) runs as ``is_causal=True`` without it: the same result, half the work."""

    def __init__(self, masks: list[torch.Tensor]):
        super().__init__()
        self.masks = masks

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mask = kwargs.get("attn_mask")
        if func is F.scaled_dot_product_attention and mask is not None and any(mask is m for m in self.masks):
            kwargs = {**kwargs, "attn_mask": None, "is_causal": True}
        return func(*args, **kwargs)


@contextmanager
def _cache_prefix(model: nn.Module, length: int, causal: bool):
    """Every layer's :class:`StaticCache` seen through a :class:`_CachePrefix` of ``length`` positions
    (other caches stay whole)."""
    masks: list[torch.Tensor] | None = [] if causal else None
    swapped = []
    layers = getattr(model, "layers", None)
    for layer in layers.values() if isinstance(layers, nn.ModuleDict) else ():
        attention = getattr(layer, "attention", None)
        cache = getattr(attention, "cache", None)
        if isinstance(cache, StaticCache):
            swapped.append((attention, cache))
            attention.cache = _CachePrefix(cache, length, masks)
    try:
        with _CausalMask(masks) if masks is not None and swapped else nullcontext():
            yield
    finally:
        for attention, cache in swapped:
            attention.cache = cache


def _compile_options(model: nn.Module) -> dict[str, Any]:
    """Inductor settings for the decode step on a CPU, each measured on the debug model (2 cores); other
    devices keep inductor's defaults (a CUDA step is Triton kernels called from the Python wrapper):

    - the C++ wrapper calls the kernels without a line of Python per op; it cannot call the
      process group's collectives (torch 2.13), so a tensor-parallel model whose ranks do not
      share memory keeps the Python wrapper (the shared memory exchange is an op it can call);
    - one thread in the generated kernels: they work on one token's vectors, too small to split,
      and an OpenMP team per kernel made 2-thread decoding collapse on a loaded machine, where the
      second thread is often not running (``benchmarks/generate_throughput.py --threads 2``).
      Matrix products keep torch's thread count.
    """
    if model_device(model).type != "cpu":
        return {}
    return {"cpp_wrapper": not inference_tp.decode_uses_process_group(model), "cpp.threads": 1}


def _has_stop(tokens: list[torch.Tensor], stops: torch.Tensor) -> bool:
    return bool(stops.numel()) and bool(torch.isin(torch.cat(tokens), stops).any())


def _cut_at_stop(tokens: list[int], stops: set[int]) -> tuple[list[int], str]:
    """The tokens up to and including the first stop token (steps after it were speculative)."""
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1], "stop_token"
    return tokens, "max_new_tokens"


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    stop_tokens: Iterable[int] = (),
    kv_cache: bool = True,
    compile: bool = False,
    vocab: int = 0,
    threads: Sequence[int] = (),
) -> Generation:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens, with a KV cache sized for this call.

    ``vocab``: choose only ids below it (the tokenizer's vocabulary); 0: any id the model has.
    ``threads``: candidate CPU thread counts, measured on the work (see :class:`Decoder`).
    ``kv_cache=False`` recomputes the whole sequence for every token (a reference for tests).
    Under tensor parallel (a model from :func:`load_model` with a mesh) every rank calls this
    and every rank gets the same tokens.
    """
    sampling = Sampling(temperature, top_k, vocab)
    if not kv_cache:
        return _generate_without_cache(model, prompt, max_new_tokens, sampling, seed, stop_tokens)
    decoder = Decoder(model, len(prompt) + max_new_tokens, compile=compile, threads=threads)
    try:
        return decoder.generate(prompt, max_new_tokens, sampling, seed=seed, stop_tokens=stop_tokens)
    finally:
        decoder.close()


def _generate_without_cache(model, prompt, max_new_tokens, sampling, seed, stop_tokens) -> Generation:
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    device = model_device(model)
    key = torch.tensor(seed_key(seed), device=device)
    tokens = torch.tensor([list(prompt)], device=device)  # (1, T)
    start = time.perf_counter()
    stops = set(stop_tokens)
    for _ in range(max_new_tokens):
        position = torch.tensor([tokens.shape[1]], device=device)
        tokens = torch.cat([tokens, sample(model(tokens)[:, -1], sampling, key, position)], dim=1)
        if int(tokens[0, -1]) in stops:
            break
    new, reason = _cut_at_stop(tokens[0, len(prompt):].tolist(), stops)
    return Generation(list(prompt), new, 0.0, time.perf_counter() - start, reason)


# ------------------------------------------------------------------------------ the infer-tp command


@dataclass
class RunReport:
    """What one ``infer-tp`` run did, for rank 0 to print."""

    generation: Generation
    text: str  # the generated text, stop tokens left out
    prompt: str
    rank: int
    tensor_parallel_degree: int
    sampling: Sampling
    seed: int
    checkpoint: Path
    source: CheckpointSource
    compiled: bool = False
    cache_length: int = 0  # positions of the KV cache (prompt + new tokens, rounded up to CACHE_BUCKET)
    first_token_seconds: float | None = None  # from the process's start to the first token (Linux)
    chat: dict[str, Any] | None = None  # --chat: the conversation, its template and stop tokens (prompt: templated)

    def as_dict(self) -> dict[str, Any]:
        g = self.generation
        return {
            "tokens": g.tokens,
            "text": self.text,
            "tokens_per_second": g.tokens_per_second,  # generated tokens / (prefill + decode): no compile
            "prefill_tokens_per_second": g.prefill_tokens_per_second,  # prompt tokens / prefill
            "decode_tokens_per_second": g.decode_tokens_per_second,  # tokens after the first / decode
            "prefill_seconds": g.prefill_seconds,
            "decode_seconds": g.decode_seconds,
            "compile_seconds": g.compile_seconds,
            "compiled": self.compiled,
            "first_token_seconds": self.first_token_seconds,
            "threads": g.threads,
            "cache_length": self.cache_length,
            "prompt": self.prompt,
            "prompt_tokens": g.prompt_tokens,
            "chat": self.chat,
            "stop_reason": g.stop_reason,
            "temperature": self.sampling.temperature,
            "top_k": self.sampling.top_k,
            "seed": self.seed,
            "tensor_parallel_degree": self.tensor_parallel_degree,
            "checkpoint": str(self.checkpoint),
            "checkpoint_folder": str(self.source.folder),  # the step read, when given a folder of steps
            "checkpoint_format": self.source.describe(),
        }


def run(
    checkpoint: Path,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int = 200,
    seed: int | None = None,
    config: Path | None = None,
    overrides: Sequence[str] = (),
    compile: bool | None = False,
    say: Callable[[str], None] | None = None,
    chat: bool = False,
) -> RunReport:
    """Generate from ``checkpoint`` with tensor parallel over every rank of the job (WORLD_SIZE;
    one process works too). Everything a user can get wrong is checked before any collective.

    ``compile``: compile the decode step; None (the command's default): from COMPILE_FROM_TOKENS
    new tokens on (fewer are done eagerly before a warm compile would be).

    ``say(text)`` (rank 0 only) hears each phase that may take seconds before it starts, and the
    first token as soon as it is chosen.

    ``chat``: ``prompt`` is a conversation (or one user message) to answer, rendered with the
    tokenizer's chat template; generation also stops at the template's end of turn
    (:mod:`titanctl.inference.chat_prompt`)."""
    cfg = load_config(config, list(overrides), command="infer-tp")
    conversation = chat_messages(prompt) if chat else None  # before any file is looked at
    if not chat and any(key == "sft.chat_template_path" for key, _ in parse_overrides(list(overrides))):
        raise ConfigError("--sft.chat_template_path renders the prompt of --chat only: add --chat, or leave it out")
    source = find_checkpoint(checkpoint)
    check_model_overrides(overrides, source)
    if source.args is None:
        recipe = model_args_from_config(cfg.model, 1, cfg.training.seq_len) if config is not None else None
        source = with_model(source, recipe, f"--config {config}")
    args = source.args
    named = cfg.model.tokenizer_path  # the recipe's or --model.tokenizer_path: the user's choice
    tokenizer = Tokenizer(named or checkpoint_tokenizer(source.folder) or DEFAULT_TOKENIZER_PATH)
    guessed = not named and tokenizer.path == DEFAULT_TOKENIZER_PATH
    check_vocab(args, tokenizer.vocab_size, tokenizer.path, exact=guessed)
    templated = None
    if conversation is not None:
        templated = chat_prompt(*conversation, tokenizer, cfg.sft.chat_template_path)
        prompt, prompt_ids, stop_tokens = templated.text, templated.ids, templated.stop_tokens
    else:
        prompt_ids, stop_tokens = tokenizer.encode(prompt, bos=True, eos=False), tokenizer.stop_tokens
    if not prompt_ids:
        raise ConfigError(
            f"--prompt is empty and tokenizer {tokenizer.path} has no BOS token to start from: "
            "give a prompt of at least one token"
        )
    tp = elastic.int_from_env("WORLD_SIZE", 1, minimum=1)
    check_tp_degree(args, tp)
    check_context(len(prompt_ids), max_new_tokens, args.max_seq_len)
    with torch.device("meta"):
        eager = eager_part(registry.build_model(args))
    if compile and eager:
        raise ConfigError(f"--compile: the decode step of {args.family} cannot compile as one graph ({eager}); "
                          "leave --compile out")
    if compile is None:
        compile = max_new_tokens >= COMPILE_FROM_TOKENS and not eager
    cache = cache_length(len(prompt_ids) + max_new_tokens, args.max_seq_len)
    args = args.replace(max_seq_len=cache)  # the RoPE table and KV cache length

    with peer_failures_named(elastic.int_from_env("RANK", 0, minimum=0), tp, "while loading the model"):
        env = init_process(cfg.comm.init_timeout_seconds)
        check_memory(args, tp, env.device, len(prompt_ids), max_new_tokens)

        def tell(text: str) -> None:
            if say is not None and env.rank == 0:
                say(text)

        mesh = None
        if tp > 1:
            with connecting():
                mesh = init_device_mesh(env.device.type, (tp,), mesh_dim_names=("tp",))
        seed = _agreed_seed(seed, env.device)
        tell(f"loading {source.describe()} from {source.folder}...")
        model = load_model(source, args, env.device, mesh)
    vocab = tokenizer.vocab_size if tokenizer.vocab_size < args.vocab_size else 0  # ids it can decode
    sampling = Sampling(temperature, top_k, vocab)
    first_token_seconds = None

    def first_token(token: int) -> None:
        nonlocal first_token_seconds
        first_token_seconds = process_seconds()
        shown = "" if token in stop_tokens else tokenizer.decode([token])
        after = "" if first_token_seconds is None else f" {first_token_seconds:.1f} s after the start"
        tell(f"first token{after}: {shown!r}")

    tell(f"prefill of {len(prompt_ids)} prompt tokens...")
    decoder = Decoder(model, cache, compile=compile, threads=thread_candidates(env.device))
    try:
        result = decoder.generate(prompt_ids, max_new_tokens, sampling, seed=seed, stop_tokens=stop_tokens,
                                  on_first_token=first_token, say=tell)
    finally:
        decoder.close()
    text = tokenizer.decode([t for t in result.tokens if t not in stop_tokens])
    return RunReport(result, text, prompt, env.rank, tp, sampling, seed, Path(checkpoint), source, compile, cache,
                     first_token_seconds, None if templated is None else templated.as_dict())


CACHE_BUCKET = 64  # positions
# infer-tp compiles the decode step for this many new tokens or more: compiling takes seconds even
# from inductor's cache (tens of seconds cold), and eager decoding of fewer tokens is done sooner.
COMPILE_FROM_TOKENS = 64


def cache_length(needed: int, context: int) -> int:
    """Positions of infer-tp's KV cache for ``needed`` (prompt + new tokens): rounded up to a
    multiple of CACHE_BUCKET, at most ``context``. The cache's shape is in the compiled decode
    step, so prompts of nearby lengths share one graph, and inductor's on-disk cache serves it to
    the next run; a step attends over the whole cache (masked), so the rounding costs a little
    (debug model, compiled: 505 tokens/s with a 256-position cache, 175 with 1280)."""
    return max(needed, min(context, -(-needed // CACHE_BUCKET) * CACHE_BUCKET))


def thread_candidates(device: torch.device) -> list[int]:
    """The thread counts infer-tp measures (CPU; none when OMP_NUM_THREADS says how many).

    The count the process was given (its share of the host's cores, init_process) but no more
    than the cores the load average leaves idle, and 1. On a busy host an OpenMP team waits for
    threads that are not running: the 2-thread part of a 27-token prefill's measurement took
    1.9 s on 2 cores at load average 6.7, the whole prefill at 1 thread 40 ms, so a count the host
    cannot give is not even tried."""
    count = torch.get_num_threads()
    if device.type != "cpu" or os.environ.get("OMP_NUM_THREADS") or count < 2:
        return []
    try:
        cores = len(os.sched_getaffinity(0))
        idle = cores - os.getloadavg()[0]
    except (AttributeError, OSError):
        return [count, 1]
    top = max(1, min(count, round(idle)))
    return [top, 1] if top > 1 else [1]


def process_seconds() -> float | None:
    """Seconds since this process started (Linux, 10 ms resolution); None where /proc does not say."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def check_context(prompt_tokens: int, max_new_tokens: int, context: int) -> None:
    """Refuse a generation longer than the model's context (the sequence length it was trained on,
    or a Hugging Face config's max_position_embeddings) before a KV cache is sized for it."""
    if prompt_tokens + max_new_tokens > context:
        raise ConfigError(
            f"--max-new-tokens {max_new_tokens}: the {prompt_tokens}-token prompt and the new tokens exceed the "
            f"model's context of {context} positions; at most {max(context - prompt_tokens, 0)} new tokens"
        )


def generation_bytes(args: ModelArgs, tp: int) -> tuple[int, int]:
    """(weights, KV cache) bytes one of ``tp`` processes holds to generate with ``args`` (its
    ``max_seq_len``: the cache's positions), in the dtype the model is built in. The cache of
    multi-head latent attention counts one layer's keys and values expanded from it beside it: a
    decode step expands the whole cache, a layer at a time."""
    from titanctl.models.shapes import num_params

    elem = torch.get_default_dtype().itemsize
    layers = args.n_layers  # the prediction depths' blocks have no cache: decoding never runs them
    if args.mla is not None:
        mla, heads = args.mla, args.n_heads // tp
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        per_position = layers * (mla.kv_lora_rank + mla.qk_rope_head_dim)  # the latent cache, whole on every rank
        per_position += heads * (mla.qk_nope_head_dim + mla.v_head_dim + 2 * qk)  # wkv_b's output, k and v
    else:
        per_position = layers * 2 * (args.kv_heads // tp) * args.head_dim
    return num_params(args) * elem // tp, per_position * args.max_seq_len * elem


def check_memory(args: ModelArgs, tp: int, device: torch.device, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse, before the model is built, a generation whose weights and KV cache would not fit the memory
    left (the host's MemAvailable shared by its processes; a GPU's free memory), the least any rank has:
    every rank decides alike, none goes on to wait for one that stopped."""
    if device.type == "cuda":
        available, where = torch.cuda.mem_get_info(device)[0], "a GPU has free"
    elif device.type == "cpu" and (host := available_bytes()) is not None:
        local = elastic.int_from_env("LOCAL_WORLD_SIZE", 1, minimum=1)
        available = host // local
        where = "this host has available" if local == 1 else f"each of this host's {local} processes has"
    else:
        return
    if dist.is_initialized():
        least = torch.tensor([available], dtype=torch.int64, device=device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        available = int(least.item())
    weights, cache = generation_bytes(args, tp)
    if weights + cache > available:
        raise ConfigError(
            f"the {prompt_tokens:,}-token prompt and --max-new-tokens {max_new_tokens:,} need a KV cache of "
            f"{args.max_seq_len:,} positions: {cache / 2**30:.2f} GiB beside the model's {weights / 2**30:.2f} GiB "
            f"per process, but {where} {available / 2**30:.2f} GiB; give a shorter prompt or fewer new tokens"
        )


def _agreed_seed(seed: int | None, device: torch.device) -> int:
    """The given seed, or a random one that every rank shares (ranks sample independently, so a
    seed that differed between them would make them pick different tokens)."""
    if seed is not None:
        return seed
    drawn = torch.tensor([secrets.randbelow(2**31)], device=device)
    if dist.is_initialized():
        dist.broadcast(drawn, src=0)
    return int(drawn.item())

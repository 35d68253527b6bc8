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
sharded for tensor parallel when given a mesh (``titanctl.parallel.layouts.inference_tp``: plain local
tensors, the partial outputs of ``wo`` and ``w2`` summed over the ranks, the logits gathered), and fills it.

Decoding (:class:`Decoder`): the prompt in one forward (prefill), then one token per step. The KV
cache is allocated once for prompt + new tokens and written at a position tensor, so the decode
step (one token's forward and the choice of the next, ``titanctl.tools.sampling``) is the same
computation at every position: ``torch.compile`` compiles it once. Tokens stay tensors; the host
reads them only every ``stop_check_interval`` tokens, to see whether a stop token came.

:func:`run` is what ``titanctl infer-tp`` does: start the process group, load, generate, decode.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel

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
from titanctl.models import registry
from titanctl.models.common.args import ModelArgs
from titanctl.models.registry import model_args_from_config
from titanctl.parallel.layouts import inference_tp
from titanctl.parallel.runtime import elastic
from titanctl.parallel.runtime.env import init_process
from titanctl.tools.sampling import Sampling, sample, seed_key

GREEDY = Sampling()

__all__ = [
    "CheckpointSource", "Decoder", "Generation", "RunReport", "build_model", "check_tp_degree", "check_vocab",
    "find_checkpoint", "generate", "load_model", "load_weights", "run",
]


# ------------------------------------------------------------------------------ checks and loading


def check_tp_degree(args: ModelArgs, tp: int) -> None:
    """Fail before any collective if attention heads cannot be split ``tp`` ways."""
    for what, size in (("n_heads", args.n_heads), ("n_kv_heads", args.kv_heads)):
        if size % tp:
            raise ParallelError(
                f"model {what} = {size} is not divisible by the {tp} processes of tensor parallel inference: "
                f"run with a process count that divides {args.n_heads} and {args.kv_heads}"
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


def build_model(args: ModelArgs, device: torch.device, tp_mesh=None) -> nn.Module:
    """An uninitialized model on ``device``; over ``tp_mesh`` its split weights are DTensors for
    the checkpoint reader to fill (then :func:`titanctl.parallel.layouts.inference_tp.localize`)."""
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
    compile_seconds: float = 0.0  # compiling the decode step (0 when eager or compiled before)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / max(self.prefill_seconds + self.decode_seconds, 1e-9)

    @property
    def decode_tokens_per_second(self) -> float | None:
        return (len(self.tokens) - 1) / self.decode_seconds if len(self.tokens) > 1 and self.decode_seconds else None


class Decoder:
    """A model with its KV cache allocated for ``max_seq_len`` positions and its decode step
    compiled (``compile=True``) or eager; generate with it as often as needed, then :meth:`close`.

    The cache is never cleared between generations: a step writes its position before attending,
    and attends only to positions up to its own, all written by the current generation.
    """

    def __init__(self, model: nn.Module, max_seq_len: int, *, compile: bool = False, stop_check_interval: int = 8):
        if stop_check_interval < 1:
            raise ValueError("stop_check_interval must be at least 1")
        self.model = model
        self.max_seq_len = max_seq_len
        self.stop_check_interval = stop_check_interval
        self.device = model.rope_cache.device
        model.setup_kv_cache(max_seq_len)
        self.compiled = compile
        self._step = self._decode_step
        if compile:
            self._step = torch.compile(self._decode_step, fullgraph=True, dynamic=False,
                                       options=_compile_options(model))
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

    def _decode_step(self, token: torch.Tensor, pos: torch.Tensor, sampling: Sampling, key: torch.Tensor):
        """token (1, 1) at position pos (1,) -> the next token (1, 1)."""
        # Compiled, attention in plain ops fuses into the surrounding kernels; the fused CPU
        # attention kernel costs more than the arithmetic of one query. Eager keeps the fused one.
        with sdpa_kernel(SDPBackend.MATH) if self.compiled else nullcontext():
            logits = self.model(token, input_pos=pos)[:, -1]  # (1, vocab)
        return sample(logits, sampling, key, pos + 1)

    def warm_up(self, sampling: Sampling) -> float:
        """Compile the decode step for ``sampling`` now; the seconds it took (0 if eager or done)."""
        if not self.compiled or sampling in self._warm:
            return 0.0
        start = time.perf_counter()
        with torch.no_grad():  # position 0 is rewritten by the next prefill before anyone reads it
            token = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            pos = torch.zeros(1, dtype=torch.long, device=self.device)
            self._step(token, pos, sampling, torch.tensor(0, device=self.device))
        self._warm.add(sampling)
        return time.perf_counter() - start

    @torch.no_grad()
    def generate(
        self, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling = GREEDY, *, seed: int = 0,
        stop_tokens: Iterable[int] = (),
    ) -> Generation:
        """Continue ``prompt`` by up to ``max_new_tokens`` tokens (batch of one)."""
        if not prompt:
            raise ValueError("the prompt needs at least one token")
        if len(prompt) + max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"{len(prompt)} prompt + {max_new_tokens} new tokens exceed the {self.max_seq_len}-position KV cache"
            )
        compile_seconds = self.warm_up(sampling)
        device = self.device
        key = torch.tensor(seed_key(seed), device=device)
        stops = torch.tensor(sorted(set(stop_tokens)), dtype=torch.long, device=device)
        start = time.perf_counter()
        positions = torch.arange(len(prompt), device=device)
        logits = self.model(torch.tensor([list(prompt)], device=device), input_pos=positions)[:, -1]
        token = sample(logits, sampling, key, positions[-1:] + 1)  # (1, 1)
        chosen = [token]
        stopped = _has_stop(chosen, stops)
        prefill_seconds = time.perf_counter() - start
        pos = torch.tensor([len(prompt)], device=device)
        checked = 1

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
            while not stopped and len(chosen) < max_new_tokens:
                advance()
        tokens, reason = _cut_at_stop(torch.cat(chosen).flatten().tolist(), set(stop_tokens))
        decode_seconds = time.perf_counter() - start - prefill_seconds
        return Generation(list(prompt), tokens, prefill_seconds, decode_seconds, reason, compile_seconds)


def _compile_options(model: nn.Module) -> dict[str, Any]:
    """Inductor settings for the decode step, each measured on the debug model (CPU, 2 cores):

    - the C++ wrapper calls the kernels without a line of Python per op; it cannot call the
      process group's collectives (torch 2.13), so a tensor-parallel model whose ranks do not
      share memory keeps the Python wrapper (the shared memory exchange is an op it can call);
    - one thread in the generated kernels: they work on one token's vectors, too small to split,
      and an OpenMP team per kernel made 2-thread decoding collapse on a loaded machine, where the
      second thread is often not running (``benchmarks/generate_throughput.py --threads 2``).
      Matrix products keep torch's thread count.
    """
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
) -> Generation:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens, with a KV cache sized for this call.

    ``vocab``: choose only ids below it (the tokenizer's vocabulary); 0: any id the model has.
    ``kv_cache=False`` recomputes the whole sequence for every token (a reference for tests).
    Under tensor parallel (a model from :func:`load_model` with a mesh) every rank calls this
    and every rank gets the same tokens.
    """
    sampling = Sampling(temperature, top_k, vocab)
    if not kv_cache:
        return _generate_without_cache(model, prompt, max_new_tokens, sampling, seed, stop_tokens)
    decoder = Decoder(model, len(prompt) + max_new_tokens, compile=compile)
    try:
        return decoder.generate(prompt, max_new_tokens, sampling, seed=seed, stop_tokens=stop_tokens)
    finally:
        decoder.close()


def _generate_without_cache(model, prompt, max_new_tokens, sampling, seed, stop_tokens) -> Generation:
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    device = model.rope_cache.device
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

    def as_dict(self) -> dict[str, Any]:
        g = self.generation
        return {
            "tokens": g.tokens,
            "text": self.text,
            "tokens_per_second": g.tokens_per_second,
            "decode_tokens_per_second": g.decode_tokens_per_second,
            "prefill_seconds": g.prefill_seconds,
            "decode_seconds": g.decode_seconds,
            "compile_seconds": g.compile_seconds,
            "prompt": self.prompt,
            "prompt_tokens": g.prompt_tokens,
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
    compile: bool = False,
) -> RunReport:
    """Generate from ``checkpoint`` with tensor parallel over every rank of the job (WORLD_SIZE;
    one process works too). Everything a user can get wrong is checked before any collective."""
    cfg = load_config(config, list(overrides), command="infer-tp")
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
    prompt_ids = tokenizer.encode(prompt, bos=True, eos=False)
    if not prompt_ids:
        raise ConfigError(
            f"--prompt is empty and tokenizer {tokenizer.path} has no BOS token to start from: "
            "give a prompt of at least one token"
        )
    tp = elastic.int_from_env("WORLD_SIZE", 1, minimum=1)
    check_tp_degree(args, tp)
    check_context(len(prompt_ids), max_new_tokens, args.max_seq_len)
    args = args.replace(max_seq_len=len(prompt_ids) + max_new_tokens)  # the RoPE table and KV cache length

    env = init_process(cfg.comm.init_timeout_seconds)
    mesh = None
    if tp > 1:
        mesh = init_device_mesh(env.device.type, (tp,), mesh_dim_names=("tp",))
    seed = _agreed_seed(seed, env.device)
    model = load_model(source, args, env.device, mesh)
    vocab = tokenizer.vocab_size if tokenizer.vocab_size < args.vocab_size else 0  # ids it can decode
    result = generate(model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                      stop_tokens=tokenizer.stop_tokens, compile=compile, vocab=vocab)
    text = tokenizer.decode([t for t in result.tokens if t not in tokenizer.stop_tokens])
    return RunReport(result, text, prompt, env.rank, tp, Sampling(temperature, top_k, vocab), seed,
                     Path(checkpoint), source)


def check_context(prompt_tokens: int, max_new_tokens: int, context: int) -> None:
    """Refuse a generation longer than the model's context (the sequence length it was trained on,
    or a Hugging Face config's max_position_embeddings) before a KV cache is sized for it."""
    if prompt_tokens + max_new_tokens > context:
        raise ConfigError(
            f"--max-new-tokens {max_new_tokens}: the {prompt_tokens}-token prompt and the new tokens exceed the "
            f"model's context of {context} positions; at most {max(context - prompt_tokens, 0)} new tokens"
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

"""Text generation with a KV cache, in one process or Tensor Parallel over all ranks.

Checkpoints (:func:`find_checkpoint`, :func:`load_weights`, from ``titanctl.checkpoint.weights``): a
titanctl DCP step folder (``titanctl.json`` gives the model; full training or weights-only), a plain
DCP folder (the model comes from a recipe), a folder of step folders (the newest is taken), or a
Hugging Face folder (``config.json`` + ``*.safetensors``).

Tensor parallel (:func:`build_model`): the model is built on the meta device and sharded with the
inference plan (no sequence parallel, vocabulary gathered at the output), then materialized; each
rank reads only its shards from DCP, or slices the full tensors it streams from safetensors.

Decoding (:func:`generate`): the prompt in one forward (prefill), then one token per forward
through the KV cache. Temperature 0 is greedy (argmax). Otherwise one uniform number per token,
drawn from a CPU generator seeded with ``seed``, inverts the CDF of the softmax of
``logits / temperature`` (top-k kept): the random stream does not depend on the device, the
vocabulary or the TP degree. Under TP rank 0 chooses and broadcasts each token, so every rank
decodes the same sequence.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from titanctl.checkpoint.weights import CheckpointSource, find_checkpoint, load_weights
from titanctl.errors import DataError, ParallelError
from titanctl.models.llama.args import ModelArgs
from titanctl.models.llama.model import Transformer

__all__ = [
    "CheckpointSource", "Generation", "apply_inference_tp", "build_model", "check_tp_degree", "check_vocab",
    "find_checkpoint", "generate", "load_weights", "sample_token",
]


# ------------------------------------------------------------------------------ checkpoints
# Reading weights lives in titanctl.checkpoint.weights (one reader for training, conversion and
# generation); these names stay importable from here.


def check_tp_degree(args: ModelArgs, tp: int) -> None:
    """Fail before any collective if attention heads cannot be split ``tp`` ways."""
    for what, size in (("n_heads", args.n_heads), ("n_kv_heads", args.kv_heads)):
        if size % tp:
            raise ParallelError(
                f"model {what} = {size} is not divisible by the {tp} processes of tensor parallel inference: "
                f"run with a process count that divides {args.n_heads} and {args.kv_heads}"
            )


def check_vocab(args: ModelArgs, vocab_size: int, tokenizer_path: Path) -> None:
    if args.vocab_size != vocab_size:
        raise DataError(
            f"the model has a vocabulary of {args.vocab_size} tokens but tokenizer {tokenizer_path} has "
            f"{vocab_size}: give the checkpoint's tokenizer with --config (model.tokenizer_path)"
        )


def apply_inference_tp(model: Transformer, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    from titanctl.models.llama.tp_plan import inference_block_plan, inference_root_plan

    parallelize_module(model, tp_mesh, inference_root_plan())
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, inference_block_plan())


def build_model(args: ModelArgs, device: torch.device, tp_mesh=None) -> Transformer:
    """An uninitialized model on ``device``, TP-sharded over ``tp_mesh`` when given."""
    with torch.device("meta"):
        model = Transformer(args)
    if tp_mesh is not None:
        apply_inference_tp(model, tp_mesh)
    model.to_empty(device=device)
    model.init_buffers(device)
    return model.eval()


# ------------------------------------------------------------------------------ decoding


@dataclass
class Generation:
    prompt_tokens: list[int]
    tokens: list[int]  # generated ids, a final stop token included
    prefill_seconds: float  # prompt forward + first token
    decode_seconds: float  # the other tokens
    stop_reason: str  # "stop_token" or "max_new_tokens"

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / max(self.prefill_seconds + self.decode_seconds, 1e-9)

    @property
    def decode_tokens_per_second(self) -> float | None:
        return (len(self.tokens) - 1) / self.decode_seconds if len(self.tokens) > 1 and self.decode_seconds else None


def sample_token(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """One token from logits (vocab,): argmax at temperature 0, else the inverse CDF of one uniform draw."""
    if temperature <= 0:
        return int(logits.argmax())
    scores = logits.detach().to("cpu", torch.float64) / temperature
    if 0 < top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    cdf = torch.softmax(scores, dim=0).cumsum(0)
    u = torch.rand((), dtype=torch.float64, generator=generator) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), scores.numel() - 1)


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    stop_tokens: Iterable[int] = (),
    kv_cache: bool = True,
    group=None,
) -> Generation:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens (batch of one).

    ``kv_cache=False`` recomputes the whole sequence for every token (a reference for tests).
    ``group``: the TP process group; rank 0 of it picks each token and broadcasts it.
    """
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    device = model.rope_cache.device
    generator = torch.Generator().manual_seed(seed)
    picks = group is None or torch.distributed.get_rank(group) == 0
    stop = set(stop_tokens)
    if kv_cache:
        model.setup_kv_cache(len(prompt) + max_new_tokens)
    tokens, new, stop_reason = list(prompt), [], "max_new_tokens"
    start = time.perf_counter()
    prefill_seconds = 0.0
    try:
        pos, step_input = 0, prompt
        for i in range(max_new_tokens):
            if kv_cache:  # the new tokens only, at their positions
                logits = model(torch.tensor([step_input], device=device), start_pos=pos)[0, -1]  # (vocab,)
            else:
                logits = model(torch.tensor([tokens], device=device))[0, -1]
            token = sample_token(logits, temperature, top_k, generator) if picks else 0
            if group is not None:
                chosen = torch.tensor([token], device=device)
                torch.distributed.broadcast(chosen, group=group, group_src=0)
                token = int(chosen.item())
            if i == 0:
                prefill_seconds = time.perf_counter() - start
            pos += len(step_input)
            tokens.append(token)
            new.append(token)
            if token in stop:
                stop_reason = "stop_token"
                break
            step_input = [token]
    finally:
        if kv_cache:
            model.clear_kv_cache()
    total = time.perf_counter() - start
    return Generation(list(prompt), new, prefill_seconds, total - prefill_seconds, stop_reason)


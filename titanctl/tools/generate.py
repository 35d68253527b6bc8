"""Text generation with a KV cache, in one process or Tensor Parallel over all ranks.

Checkpoints (:func:`find_checkpoint`): a titanctl DCP step folder (``titanctl.json`` gives the model;
full training or weights-only), a plain DCP folder (the model comes from a recipe), a folder of
step folders (the newest is taken), or a Hugging Face folder (``config.json`` + ``*.safetensors``).

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

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from titanctl.errors import CheckpointError, DataError, ParallelError
from titanctl.models.llama.args import ModelArgs
from titanctl.models.llama.model import Transformer

_STEP_DIR = re.compile(r"step-(\d+)")


# ------------------------------------------------------------------------------ checkpoints


@dataclass
class CheckpointSource:
    kind: str  # "dcp" or "hf"
    folder: Path
    args: ModelArgs | None  # None: a plain DCP folder, the model comes from a recipe
    meta: dict[str, Any] = field(default_factory=dict)  # titanctl.json, when there is one

    def describe(self) -> str:
        if self.kind == "hf":
            return "Hugging Face safetensors"
        if not self.meta:
            return "DCP"
        return f"DCP step {self.meta.get('step')}" + (" (weights only)" if self.meta.get("weights_only") else "")


def find_checkpoint(path: Path) -> CheckpointSource:
    """Tell what kind of checkpoint ``path`` is and read its model arguments."""
    from titanctl.checkpoint.metadata import METADATA_FILE, model_args_from_metadata, read_metadata

    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} does not exist or is not a folder")
    if (folder / METADATA_FILE).is_file():
        meta = read_metadata(folder)
        return CheckpointSource("dcp", folder, model_args_from_metadata(meta), meta)
    if (folder / "config.json").is_file():
        if not list(folder.glob("*.safetensors")):
            raise CheckpointError(f"{folder} has a config.json but no *.safetensors files")
        import json

        from titanctl.checkpoint.hf_names import args_from_hf_config

        try:
            config = json.loads((folder / "config.json").read_text())
        except ValueError as e:
            raise CheckpointError(f"{folder / 'config.json'} is not valid JSON: {e}") from None
        return CheckpointSource("hf", folder, args_from_hf_config(config))
    if (folder / ".metadata").is_file():
        return CheckpointSource("dcp", folder, None)
    steps = [
        (int(m.group(1)), p) for p in folder.iterdir()
        if (m := _STEP_DIR.fullmatch(p.name)) and (p / METADATA_FILE).is_file()
    ]
    if steps:
        return find_checkpoint(max(steps)[1])
    raise CheckpointError(
        f"{folder} is not a checkpoint: expected a DCP step folder (titanctl.json + .metadata), a folder of "
        "step-N folders, or a Hugging Face folder (config.json + *.safetensors)"
    )


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


def load_weights(model: Transformer, source: CheckpointSource) -> None:
    if source.kind == "hf":
        _load_hf(model, source.folder)
    else:
        _load_dcp(model, source.folder)


def _load_dcp(model: Transformer, folder: Path) -> None:
    """Each rank reads its own shards of the model keys (other top-level entries are left alone)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        stored = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    except Exception as e:
        raise CheckpointError(f"{folder}: unreadable DCP metadata ({type(e).__name__}: {e})") from None
    state = model.state_dict()
    for name, tensor in state.items():
        if name not in stored:
            raise CheckpointError(f"{folder} lacks model tensor {name!r}")
        size = getattr(stored[name], "size", None)
        if size is not None and tuple(size) != tuple(tensor.shape):
            raise CheckpointError(
                f"{folder}: tensor {name!r} has shape {tuple(size)}, the model expects {tuple(tensor.shape)}"
            )
    try:
        dcp.load(state, checkpoint_id=str(folder), no_dist=not torch.distributed.is_initialized())
    except CheckpointException as e:  # a BaseException: `except Exception` would miss it
        raise CheckpointError(f"{folder}: loading failed: {str(e).splitlines()[0] if str(e) else e!r}") from None


def _safetensors_pairs(folder: Path) -> Iterable[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@torch.no_grad()
def _load_hf(model: Transformer, folder: Path) -> None:
    """Stream full tensors one at a time; each rank keeps its slice (no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from titanctl.checkpoint.hf_names import iter_from_hf

    params = dict(model.named_parameters())
    for name, full in iter_from_hf(_safetensors_pairs(folder), model.args):
        param = params[name]
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)


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


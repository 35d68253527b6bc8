"""Validation while training: the mean next-token loss, and its perplexity, on held-out data.

Every evaluation reads the same batches: the validation set's windows of seq_len + 1 tokens in
file order, from the first, never shuffled. A validation batch has the training's global batch
size, cut over data-parallel ranks and microbatches as the ranks' shares of every microbatch, and
the number of batches does not depend on the layout either:
so the validation loss, like the training loss, is the mean over the same tokens under every
layout (each microbatch's summed token losses divided by the evaluation's count of tokens that
count, all-reduced, as titanctl/train/step.py and reductions.py do for the training loss).

Training is left as it was: no gradients, the modules put back in their mode, the RNG states
restored, the training loader never read. tests/unit/train/test_validation.py checks that the training
losses are bit-identical with validation on and off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from titanctl.config.job_config import JobConfig, Validation
from titanctl.data.chat import is_chat
from titanctl.data.chat_pack import IGNORE_INDEX, LABELS, POSITIONS, TOKENS, text_windows_as_rows
from titanctl.data.dataloader import Microbatch, tokenize_finite
from titanctl.data.datasets import load_documents
from titanctl.data.mixture import chat_source
from titanctl.data.tokenizer import Tokenizer
from titanctl.errors import ConfigError, DataError, counted
from titanctl.parallel.layouts.dims import ParallelDims
from titanctl.parallel.layouts.reductions import global_mean_loss
from titanctl.train.step import ForwardBackward


@dataclasses.dataclass(frozen=True)
class ValidationResult:
    step: int
    loss: float  # mean token cross-entropy over every token of the evaluation's batches
    batches: int
    tokens: int  # over all ranks
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 709 else math.inf  # exp overflows a float past ~709.78

    def metrics(self) -> dict[str, float]:
        """The fields of the step's metrics.jsonl row (TensorBoard: validation/loss, validation/perplexity)."""
        return {"val_loss": self.loss, "val_perplexity": self.perplexity}

    def describe(self) -> str:
        return (
            f"validation at step {self.step}: loss {self.loss:.4f}  perplexity {self.perplexity:.2f}  "
            f"({self.batches} batch(es), {self.tokens:,} tokens, {self.seconds:.2f} s)"
        )


class ValidationSet:
    """The held-out windows in file order, and this data-parallel rank's share of each batch.

    Text is cut into windows of seq_len + 1 tokens; chat data comes as packed windows (n, 3, seq_len) of
    tokens, labels and positions (chat_pack.py). In a chat run (``chat_rows``) text windows take that
    layout too, so that every microbatch carries positions."""

    def __init__(
        self, tokens: np.ndarray, description: str, *, seq_len: int, global_batch_size: int,
        local_batch_size: int, dp_rank: int, dp_degree: int, steps: int, chat_rows: bool = False,
        bos_id: int | None = None,
    ) -> None:
        if steps == 0 or steps < -1:
            raise ConfigError(f"config key 'validation.steps' = {steps} must be -1 (the whole validation set) or >= 1")
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.note: str | None = None  # what became of a chat set's rows, said at start
        if tokens.ndim == 3:  # packed chat windows
            n_windows = len(tokens)
            self.windows = tokens
        else:
            n_windows = len(tokens) // (seq_len + 1)
            # (n_tokens,) -> (n_windows, seq_len + 1); a view, the tail that fills no window is dropped
            self.windows = tokens[: n_windows * (seq_len + 1)].reshape(n_windows, seq_len + 1)
            if chat_rows:
                self.windows = text_windows_as_rows(self.windows, bos_id)
        available = n_windows // global_batch_size
        if available == 0:
            raise DataError(
                f"validation dataset {description} has {counted(n_windows, 'window')} of seq_len={seq_len}, fewer "
                f"than one validation batch (the global batch) of "
                f"{global_batch_size}; give validation.dataset_path more data, or lower training.seq_len "
                "or training.global_batch_size"
            )
        if steps > available:
            raise DataError(
                f"config key 'validation.steps' = {steps} asks for more batches than validation dataset "
                f"{description} holds: {counted(n_windows, 'window')} of seq_len+1={seq_len + 1} make "
                f"{counted(available, 'batch', 'batches')} of {global_batch_size}; set validation.steps to at most "
                f"{available}, or -1 for all"
            )
        self.batches = available if steps == -1 else steps

    @classmethod
    def from_config(
        cls, cfg: JobConfig, tokenizer: Tokenizer, *, global_batch_size: int, dp_rank: int, dp_degree: int,
        chat: bool = False,
    ) -> ValidationSet:
        """``chat``: the training data is chat data (its microbatches carry positions)."""
        v = cfg.validation
        name = v.dataset
        sizes = dict(seq_len=cfg.training.seq_len, global_batch_size=global_batch_size,
                     local_batch_size=cfg.training.local_batch_size, dp_rank=dp_rank, dp_degree=dp_degree,
                     steps=v.steps)
        if is_chat(name):
            if v.dataset_path:
                raise ConfigError(f"config key 'validation.dataset_path' = {v.dataset_path!r}: validation.dataset "
                                  f"= {name!r} names its files itself; unset validation.dataset_path")
            source = chat_source(name, cfg.sft, cfg.sft.validation_split)
            windows = source.windows(tokenizer, cfg.training.seq_len)
            data = cls(windows, source.description, **sizes)
            data.note = "validation " + source.report.summary()
            return data
        if v.dataset_path:  # a path alone is enough, as for training.dataset_path
            if name not in ("bundled_val", "bundled", "local"):
                raise ConfigError(
                    f"config key 'validation.dataset_path' = {v.dataset_path!r} reads local files, but "
                    f"validation.dataset = {name!r}; unset one of them"
                )
            name = "local"
        elif name == "local":
            raise ConfigError("config key 'validation.dataset' = 'local' needs validation.dataset_path=FILE_OR_FOLDER")
        source = load_documents(name, v.dataset_path or None)
        if source.streaming:
            raise ConfigError(
                f"config key 'validation.dataset' = {v.dataset!r} streams; validation reads the same batches "
                "every time from a finite source: bundled_val, bundled, or local (with validation.dataset_path)"
            )
        return cls(tokenize_finite(source, tokenizer), source.description, **sizes, chat_rows=chat,
                   bos_id=tokenizer.bos_id)

    @property
    def microbatches_per_batch(self) -> int:
        return self.global_batch_size // (self.local_batch_size * self.dp_degree)

    def batch(self, index: int) -> list[Microbatch]:
        """This rank's microbatches of validation batch ``index``: windows b*G + m*(dp*lb) + r*lb + j
        for j < lb (the batch is the same G windows under every layout; only the mean is taken)."""
        lb, per_microbatch = self.local_batch_size, self.local_batch_size * self.dp_degree
        out = []
        for m in range(self.microbatches_per_batch):
            first = index * self.global_batch_size + m * per_microbatch + self.dp_rank * lb
            batch = torch.from_numpy(np.array(self.windows[first : first + lb], dtype=np.int64))  # (lb, seq_len + 1)
            if batch.dim() == 3:  # (lb, 3, seq_len): tokens, labels, positions
                out.append(tuple(batch[:, row].contiguous() for row in (TOKENS, LABELS, POSITIONS)))
            else:
                out.append((batch[:, :-1].contiguous(), batch[:, 1:].contiguous()))
        return out

    def counted_tokens(self) -> int:
        """Labels this rank's microbatches of every batch count (not IGNORE_INDEX)."""
        rows = [index * self.global_batch_size + m * self.local_batch_size * self.dp_degree
                + self.dp_rank * self.local_batch_size + j
                for index in range(self.batches) for m in range(self.microbatches_per_batch)
                for j in range(self.local_batch_size)]
        if self.windows.ndim == 2:
            return len(rows) * self.seq_len
        return int((self.windows[rows, LABELS] != IGNORE_INDEX).sum())


def _no_watch(label: str):
    return contextlib.nullcontext()


class Validator:
    """Runs an evaluation through the training's own model parts, layout and loss."""

    def __init__(self, cfg: Validation, data: ValidationSet, forward: ForwardBackward, dims: ParallelDims):
        self.freq = cfg.freq
        self.data = data
        self.forward = forward
        self.dims = dims

    def due(self, step: int, last: bool) -> bool:
        return step % self.freq == 0 or last

    def run(self, step: int, watch: Callable[[str], contextlib.AbstractContextManager] = _no_watch) -> ValidationResult:
        """One evaluation (every rank, same steps: it runs collectives). ``watch(label)`` guards each
        batch, e.g. the hang watchdog's."""
        started = time.perf_counter()
        modules = [m for part in self.forward.model_parts for m in part.modules()]
        modes = [m.training for m in modules]
        device = self.forward.device
        rng_devices = [device] if device.type != "cpu" else []
        total = None
        with torch.random.fork_rng(devices=rng_devices, device_type=device.type if rng_devices else "cuda"):
            with torch.no_grad():
                try:
                    for module in modules:
                        module.eval()
                    with watch(f"step {step} (validation token count)"):  # an all-reduce for chat data
                        counted = torch.tensor(self.data.counted_tokens(), dtype=torch.int64, device=device)
                        divisor = self.forward.loss_divisor(counted)
                    for b in range(self.data.batches):
                        with watch(f"step {step} (validation batch {b + 1}/{self.data.batches})"):
                            for inputs, labels, *positions in self.data.batch(b):
                                loss = self._microbatch_loss(inputs.to(device), labels.to(device), divisor,
                                                             positions[0].to(device) if positions else None)
                                if loss is not None:  # None off the last pipeline stage
                                    total = loss if total is None else total + loss
                    with watch(f"step {step} (validation loss)"):
                        loss = global_mean_loss(total, self.dims).item()
                finally:
                    for module, mode in zip(modules, modes):
                        module.training = mode  # each module's own flag, as it was
        tokens = self.data.batches * self.data.global_batch_size * self.data.seq_len
        return ValidationResult(step, loss, self.data.batches, tokens, time.perf_counter() - started)

    def _microbatch_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, divisor: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Summed token losses of one microbatch / ``divisor``, through the training's own forward (masks,
        layouts), without backward; None off the last pipeline stage."""
        loss = self.forward.microbatch(inputs, labels, divisor, positions=positions, backward=False)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss  # loss parallel: replicated over tp

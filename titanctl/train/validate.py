"""Validation while training: the mean next-token loss, and its perplexity, on held-out data.

Every evaluation reads the same batches: the validation set's windows of seq_len + 1 tokens in
file order, from the first, never shuffled. A validation batch has the training's global batch
size, cut over data-parallel ranks and microbatches as the ranks' shares of every microbatch, and
the number of batches does not depend on the layout either:
so the validation loss, like the training loss, is the mean over the same tokens under every
layout (the sum of the microbatch means, all-reduced, divided by their count, as
titanctl/parallel/layouts/reductions.py reduces the training loss).

Training is left as it was: no gradients, the modules put back in their mode, the RNG states
restored, the training loader never read. tests/unit/test_validation.py checks that the training
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
from titanctl.data.dataloader import Microbatch, tokenize_finite
from titanctl.data.datasets import load_documents
from titanctl.data.tokenizer import Tokenizer
from titanctl.errors import ConfigError, DataError
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
    """The held-out windows in file order, and this data-parallel rank's share of each batch."""

    def __init__(
        self, tokens: np.ndarray, description: str, *, seq_len: int, global_batch_size: int,
        local_batch_size: int, dp_rank: int, dp_degree: int, steps: int,
    ) -> None:
        if steps == 0 or steps < -1:
            raise ConfigError(f"config key 'validation.steps' = {steps} must be -1 (the whole validation set) or >= 1")
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        n_windows = len(tokens) // (seq_len + 1)
        # (n_tokens,) -> (n_windows, seq_len + 1); a view, the tail that fills no window is dropped
        self.windows = tokens[: n_windows * (seq_len + 1)].reshape(n_windows, seq_len + 1)
        available = n_windows // global_batch_size
        if available == 0:
            raise DataError(
                f"validation dataset {description} has {len(tokens)} tokens = {n_windows} windows of "
                f"seq_len+1={seq_len + 1}, fewer than one validation batch (the global batch) of "
                f"{global_batch_size}; give validation.dataset_path more data, or lower training.seq_len "
                "or training.global_batch_size"
            )
        if steps > available:
            raise DataError(
                f"config key 'validation.steps' = {steps} asks for more batches than validation dataset "
                f"{description} holds: {n_windows} windows of seq_len+1={seq_len + 1} make {available} "
                f"batch(es) of {global_batch_size}; set validation.steps to at most {available}, or -1 for all"
            )
        self.batches = available if steps == -1 else steps

    @classmethod
    def from_config(
        cls, cfg: JobConfig, tokenizer: Tokenizer, *, global_batch_size: int, dp_rank: int, dp_degree: int
    ) -> ValidationSet:
        v = cfg.validation
        name = v.dataset
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
        return cls(
            tokenize_finite(source, tokenizer), source.description, seq_len=cfg.training.seq_len,
            global_batch_size=global_batch_size, local_batch_size=cfg.training.local_batch_size,
            dp_rank=dp_rank, dp_degree=dp_degree, steps=v.steps,
        )

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
            out.append((batch[:, :-1].contiguous(), batch[:, 1:].contiguous()))
        return out


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
        total, count = None, 0
        with torch.random.fork_rng(devices=rng_devices, device_type=device.type if rng_devices else "cuda"):
            with torch.no_grad():
                try:
                    for module in modules:
                        module.eval()
                    for b in range(self.data.batches):
                        with watch(f"step {step} (validation batch {b + 1}/{self.data.batches})"):
                            for inputs, labels in self.data.batch(b):
                                loss = self._microbatch_loss(inputs.to(device), labels.to(device))
                                count += 1
                                if loss is not None:  # None off the last pipeline stage
                                    total = loss if total is None else total + loss
                    mean = None if total is None else total / count
                    with watch(f"step {step} (validation loss)"):
                        loss = global_mean_loss(mean, self.dims).item()
                finally:
                    for module, mode in zip(modules, modes):
                        module.training = mode  # each module's own flag, as it was
        tokens = self.data.batches * self.data.global_batch_size * self.data.seq_len
        return ValidationResult(step, loss, self.data.batches, tokens, time.perf_counter() - started)

    def _microbatch_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Mean loss of one microbatch through the training's own forward (masks, layouts), without
        backward; None off the last pipeline stage."""
        loss = self.forward.microbatch(inputs, labels, 1.0, backward=False)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss  # loss parallel: replicated over tp

"""The training loss: cross-entropy summed over the tokens that count, divided by a step's count.

The loss of a step is the mean over every counted token (label not IGNORE_INDEX) of the global batch,
whatever its split into microbatches, pipeline microbatches, data-parallel and context-parallel
ranks: a mean of per-microbatch means would weigh a token of a microbatch with few counted tokens
(chat data: few assistant tokens) more than one of a full microbatch. So each piece contributes the
sum of its tokens' losses divided by the step's ``loss_divisor`` (train/step.py), which is the same
for every piece.
"""

import functools

import torch
import torch.nn.functional as F

from titanctl.config.job_config import JobConfig

# A label that no loss counts (F.cross_entropy's default): positions with nothing to predict. The chat
# loader writes it into labels.
from titanctl.data.chat_pack import IGNORE_INDEX


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over the labels that are not IGNORE_INDEX; logits (B, T, vocab) are upcast
    so bf16 runs reduce in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The sum of the next-token losses of the labels that are not IGNORE_INDEX (0 when there are none)."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


@functools.cache
def _compiled(loss):
    return torch.compile(loss, fullgraph=True)  # built once: it imports dynamo


def _maybe_compiled(loss, cfg: JobConfig, tp: int):
    loss_parallel = tp > 1 and not cfg.parallelism.disable_loss_parallel
    return _compiled(loss) if cfg.compile.enable and not loss_parallel else loss


def build_loss_fn(cfg: JobConfig, tp: int):
    """The loss of a run (``cross_entropy_sum``): compiled with compile.enable, which fuses the upcast,
    log-softmax and label pick over the vocabulary into one pass forward and one backward, without an
    fp32 log-softmax of the whole (B, T, vocab) logits in memory. Eager under TP's loss parallel, whose
    logits are DTensors sharded over the vocabulary."""
    return _maybe_compiled(cross_entropy_sum, cfg, tp)


def build_mean_loss_fn(cfg: JobConfig, tp: int):
    """``cross_entropy_loss`` (a mean), compiled as ``build_loss_fn``: multi-token prediction's depths."""
    return _maybe_compiled(cross_entropy_loss, cfg, tp)

import functools

import torch
import torch.nn.functional as F

from titanctl.config.job_config import JobConfig

IGNORE_INDEX = -100  # a label that no loss counts (F.cross_entropy's default): positions with nothing to predict


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over the labels that are not IGNORE_INDEX; logits (B, T, vocab) are upcast
    so bf16 runs reduce in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX)


@functools.cache
def _compiled_cross_entropy_loss():
    return torch.compile(cross_entropy_loss, fullgraph=True)  # built once: it imports dynamo


def build_loss_fn(cfg: JobConfig, tp: int):
    """The loss of a run: compiled with compile.enable, which fuses the upcast, log-softmax and
    label pick over the vocabulary into one pass forward and one backward, without an fp32
    log-softmax of the whole (B, T, vocab) logits in memory. Eager under TP's loss parallel, whose
    logits are DTensors sharded over the vocabulary."""
    loss_parallel = tp > 1 and not cfg.parallelism.disable_loss_parallel
    return _compiled_cross_entropy_loss() if cfg.compile.enable and not loss_parallel else cross_entropy_loss

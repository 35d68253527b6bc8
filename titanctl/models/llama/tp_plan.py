"""Llama's tensor-parallel plan: module name -> parallel style.

Sequence parallel keeps activations sharded on the sequence dim (Shard(1)) between
blocks and around the norms; attention and the MLP gather the sequence, shard heads /
hidden units (colwise in, rowwise out) and scatter back. With loss parallel the output
layer leaves logits sharded on the vocabulary and the loss is computed on the shards.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)


def root_plan(loss_parallel: bool) -> dict[str, ParallelStyle]:
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }


def block_plan() -> dict[str, ParallelStyle]:
    return {
        "attention_norm": SequenceParallel(),
        # The block passes (hidden, rope): gather the hidden states, leave the rope table alone.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


# Inference: no sequence parallel, so a single decoded token (T = 1) needs no sequence split.
# Activations between blocks stay replicated plain tensors; each block shards heads / hidden
# units (colwise in, rowwise out, one all-reduce each for attention and the MLP), so the KV
# cache holds only this rank's heads. The output layer gathers the whole vocabulary.


def inference_root_plan() -> dict[str, ParallelStyle]:
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }


def inference_block_plan() -> dict[str, ParallelStyle]:
    return {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }

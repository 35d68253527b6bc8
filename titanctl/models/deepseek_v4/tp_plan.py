"""DeepSeek-V4's tensor-parallel plan: query heads split (with their sinks and the grouped output
projection's groups), everything that one key-and-value head or one token's choice feeds kept whole on every
rank, and sequence parallel between the blocks: the hyper-connection streams, the norms and the final collapse
run on each rank's part of the sequence.

What is split, as torchtitan's plan (pytorch/torchtitan#3634, deepseek_v4/sharding.py) splits it: ``q_b_proj``
column-wise by query heads, ``sinks`` with them, ``o_a_proj``'s rows by head group (a rank holds whole groups,
whose heads are its own), ``o_b_proj`` row-wise, its partial sums reduce-scattered onto the sequence.

What stays whole on every rank, and why:
- the shared-KV MQA head (``kv_proj``, ``kv_norm``) and the query latent (``q_a_proj``, ``q_a_norm``): one
  head (and one latent) that every query head reads; split, each rank would need all of it anyway. The key's
  gradient is summed over the ranks' heads (``SharedKV``), the latent's by ``q_b_proj``'s column split.
- the compressors and the lightning indexer (their linears, norms and ``position_bias``): one compressed
  entry per window, shared by all heads, and the indexer's top-k must choose the same entries on every rank.
  It does: every rank runs it on the same gathered sequence with the same weights, so its scores and top-k are
  equal bit for bit. Its loss's target, the attention summed over the heads, is summed over the ranks
  (``HeadSum``), so every rank trains it alike.
- mHC's mixing (``attn_hc``, ``ffn_hc``, ``hc_head``): per token, on each rank's part of the sequence, its
  weights' gradients summed over the parts (as a norm's under sequence parallel).
- the MoE layers (router, routed and shared experts, the hash table) as DeepSeek-V3's: each runs whole on the
  gathered sequence (the token ids whole beside it), then each rank keeps its part; the routed experts are
  replicated over TP by the layouts (split over EP when it is on).
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from titanctl.models.common.args import ModelArgs
from titanctl.models.common.tp_plan import root_plan
from titanctl.models.spec import TPPlan

COMPRESSOR = ("kv_proj", "gate_proj", "kv_norm")
REPLICATED = (
    *(f"self_attn.{name}" for name in ("q_a_proj", "q_a_norm", "kv_proj", "kv_norm")),
    *(f"self_attn.compressor.{name}" for name in COMPRESSOR),
    "self_attn.indexer.q_b_proj", "self_attn.indexer.weights_proj",
    *(f"self_attn.indexer.compressor.{name}" for name in COMPRESSOR),
    "mlp.router",
)
HYPER_CONNECTION_PARAMS = tuple(f"{hc}.{p}" for hc in ("attn_hc", "ffn_hc") for p in ("fn", "base", "scale"))
REPLICATED_PARAMS = (*HYPER_CONNECTION_PARAMS, "self_attn.compressor.position_bias",
                     "self_attn.indexer.compressor.position_bias")


def root(loss_parallel: bool) -> dict[str, ParallelStyle]:
    """The shared decoder's root (embedding onto the sequence shards, norm, output), and the streams' final
    collapse on each rank's part of the sequence."""
    return {**root_plan(loss_parallel), "hc_head": SequenceParallel(use_local_output=True)}


def block(args: ModelArgs, float8=None, float8_linears=()) -> dict[str, ParallelStyle]:
    # A hyper-connection mixes one token's streams: the streams (B, S/tp, n, D) in, (post, comb, the block's
    # input) out, all on this rank's part of the sequence; its weights are replicated DTensors
    # (REPLICATED_PARAMS), so their gradients sum over the parts.
    streams_mixing = PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
        output_layouts=(Shard(1),) * 3, desired_output_layouts=(Shard(1),) * 3, use_local_output=True)
    return {
        "attn_hc": streams_mixing,
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                        use_local_output=True),
        "self_attn.q_b_proj": ColwiseParallel(),
        "self_attn.head_sum": PrepareModuleOutput(output_layouts=(Partial(),), desired_output_layouts=(Replicate(),),
                                                  use_local_output=True),
        "self_attn.o_b_proj": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_hc": streams_mixing,
        "post_attention_layernorm": SequenceParallel(),
        # Whole on every rank on the gathered sequence, beside the token ids (hash routing) that every rank
        # holds whole; then each rank keeps its part.
        "mlp": PrepareModuleInputOutput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True),
    }


def split_sizes(args: ModelArgs) -> list[tuple[str, int]]:
    """Query heads, and the output projection's head groups (a rank holds whole groups)."""
    return [("model n_heads", args.n_heads),
            ("model compressed_attention.o_groups", args.compressed_attention.o_groups)]


DEEPSEEK_V4_TP_PLAN = TPPlan(root=root, block=block, replicated=REPLICATED, summed_gradient=("self_attn.shared_kv",),
                             head_params=("self_attn.sinks", "self_attn.o_a_proj.weight"),
                             replicated_params=REPLICATED_PARAMS, split_sizes=split_sizes)

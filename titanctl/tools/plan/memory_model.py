"""The planner's fast memory path: per-rank peak bytes of a layout, from formulas over the model's shapes.

It ranks thousands of layouts in milliseconds; the finalists get ``estimate-memory``'s exact figure
(``search.exact_memory``). The terms, per rank (the pipeline rank that holds the most):

- training state: fp32 parameters, gradients and Adam's two moments, 16 bytes per parameter this
  rank holds (after TP and EP), divided by the FSDP degree dp_shard x cp (experts: by the ranks that
  shard them); DDP keeps it whole and adds its gradient buckets (4 bytes per parameter);
- FSDP's gathered copies: two blocks' parameters in the compute dtype (the one running and the one
  prefetched) and one block's gradients before their reduce-scatter (in the compute dtype, plus an
  fp32 copy when gradients are reduced in fp32); under pipelining parameters stay gathered for the
  whole step (``fsdp_reshard_after_forward`` default), so the whole stage's;
- activations saved for backward, per token and block: what each matmul's backward needs (the
  linears' outputs that later ops keep, the attention output, the SwiGLU product), the norms'
  inputs and outputs, and under TP with sequence parallel the gathered inputs of the column-wise
  linears; activation checkpointing keeps only block inputs (full), every second block's (selective
  2), or about half the matmul outputs (selective op), and recomputes one block in backward;
- blocks in flight: without pipelining one microbatch of every block; under a pipeline the
  microbatches each schedule keeps alive on a rank (1F1B: up to pp; GPipe and LoopedBFS: all of
  them; interleaved: the warm-up's (v - 1) x pp + 2 x (pp - 1) chunks);
- the loss: logits in the compute dtype and their fp32 copy (rank of the last stage);
- the device's reserve (CUDA context, communication and matmul workspaces, allocator slack).
"""

from __future__ import annotations

from dataclasses import dataclass

from titanctl.tools.plan.candidates import Candidate
from titanctl.tools.plan.workload import Block, ModelShape

GIB = 2**30


@dataclass(frozen=True)
class MemoryBreakdown:
    state: float  # parameters, gradients, optimizer state (bytes)
    gathered: float  # FSDP's unsharded parameters and gradients
    activations: float
    loss: float
    reserve: float

    @property
    def total(self) -> float:
        return self.state + self.gathered + self.activations + self.loss + self.reserve


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


@dataclass(frozen=True)
class RankView:
    """What one pipeline rank holds: its blocks (each distinct block with its count), and whether it
    has the embedding (first layer) and the output layer (last)."""
    rank: int
    blocks: tuple[tuple[Block, int], ...]
    first: bool
    last: bool


class Ranks:
    """The pipeline ranks that can hold the most, per (pp, schedule), cached for one model: rank 0
    (the first stages, which take the extra layers, and the embedding; under V schedules the last
    stage too) and the rank of the last stage (the output layer and the loss)."""

    def __init__(self, shape: ModelShape):
        self.shape = shape
        self._cache: dict[tuple[int, str], list[RankView]] = {}

    def views(self, pp: int, schedule: str) -> list[RankView]:
        key = (pp, schedule if pp > 1 else "")
        if key not in self._cache:
            self._cache[key] = self._views(pp, key[1])
        return self._cache[key]

    def _views(self, pp: int, schedule: str) -> list[RankView]:
        n = self.shape.n_layers
        if pp == 1:
            return [_view(self.shape, 0, range(n))]
        from titanctl.parallel.layouts.pipeline_parallel import stage_ids_for_rank
        from titanctl.parallel.layouts.pipeline_stages import V_SCHEDULES, pipeline_layer_ranges

        ranges = pipeline_layer_ranges(n, pp, schedule)
        style = "v" if schedule in V_SCHEDULES else "loop"
        views = []
        for rank in sorted({0, pp - 1}):
            layers = [layer for s in stage_ids_for_rank(rank, pp, len(ranges), style) for layer in ranges[s]]
            views.append(_view(self.shape, rank, layers))
        return views


def _view(shape: ModelShape, rank: int, layers) -> RankView:
    counts: dict[Block, int] = {}
    for i in layers:
        counts[shape.blocks[i]] = counts.get(shape.blocks[i], 0) + 1
    layers = list(layers)
    return RankView(rank, tuple(counts.items()), 0 in layers, shape.n_layers - 1 in layers)


def chunks_in_flight(c: Candidate, rank: int, stages_per_rank: int) -> int:
    """Microbatch x stage chunks whose activations a pipeline rank holds at once, at most."""
    m, p, v = c.microbatches, c.pp, stages_per_rank
    schedule = c.pp_schedule
    if schedule in ("GPipe", "LoopedBFS"):
        return m * v
    if schedule == "1F1B":
        return min(m, p - rank)
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        return min(m * v, (v - 1) * p + 2 * (p - 1 - rank) + 1)
    if schedule == "ZBVZeroBubble":
        return min(2 * m, 2 * p)
    if schedule == "DualPipeV":
        return min(2 * m, 2 * p + 2)
    return m * v


def activation_bytes_per_token(block: Block, tp: int, dim: int, act: int, ac: str) -> tuple[float, float]:
    """(bytes kept per token by this block until its backward, bytes of one block recomputed in backward)."""
    outputs = sum(lin.local(tp)[0] for lin in block.linears if lin.split != "row")
    row_inputs = sum(lin.local(tp)[1] for lin in block.linears if lin.split == "row")
    norms = 4 * dim / tp + (2 * dim if tp > 1 else 0)  # in/out of two norms; gathered inputs under SP
    full = outputs + 2 * row_inputs + norms  # row inputs: the tensor and the op that made it (sdpa out, silu x w3)
    # A 16-bit run's norms compute in fp32: their fp32 input copies stay too (as 4-byte elements).
    norm_fp32 = 2 * 2 * dim / tp if act == 2 else 0.0
    if block.experts is not None:
        e = block.experts
        per_routed = sum(o for o, _ in e.matrices) + 2 * e.matrices[1][1]
        # Per token of the whole sequence: under TP each rank runs the MoE layer on all of it;
        # the dispatched copies of the token for each of its top_k experts, there and back.
        full += e.top_k * (per_routed + 2 * dim)
    block_input = dim / tp if tp > 1 else dim
    kept = {
        "none": full,
        # every second matmul's output (outputs of row-wise linears are dim wide)
        "selective_op": block_input + 0.5 * (outputs + dim * sum(lin.split == "row" for lin in block.linears)),
        "selective_2": (full + block_input) / 2,
        "full": block_input,
    }[ac]
    if ac == "none":
        kept += norm_fp32
    recompute = 0.0 if ac in ("none", "selective_op") else full + norm_fp32
    return kept * act, recompute * act


def estimate(shape: ModelShape, ranks: Ranks, c: Candidate, *, seq_len: int, param_dtype: str,
             reduce_dtype: str, reshard_after_forward: str, reserve_gib: float) -> MemoryBreakdown:
    """The fast estimate of the peak of the pipeline rank that holds the most."""
    act = _dtype_bytes(param_dtype)
    pbytes = _dtype_bytes(param_dtype)
    grad_extra = 4 if reduce_dtype == "float32" and pbytes == 2 else 0
    shard = c.dp_shard * c.cp if c.fsdp else 1
    expert_shard = max(1, c.dp_shard * c.cp // c.ep) if c.fsdp else 1
    gathered_whole = c.pp > 1 if reshard_after_forward == "default" else reshard_after_forward == "never"
    tokens = (c.pp_microbatch_size if c.pp > 1 else c.local_batch_size) * seq_len / c.cp
    stages_per_rank = 1 if c.pp == 1 else _stages_per_rank(c)
    best = None
    for view in ranks.views(c.pp, c.pp_schedule):
        dense = sum(n * (b.params(c.tp, c.ep) - b.expert_params(c.ep)) for b, n in view.blocks)
        experts = sum(n * b.expert_params(c.ep) for b, n in view.blocks)
        root = (shape.embedding_params / c.tp if view.first else 0) + (
            (shape.output_params / c.tp + shape.final_norm_params) if view.last else 0)
        state = 16 * ((dense + root) / shard + experts / expert_shard)
        if c.ddp:
            state += 4 * (dense + root + experts)
        biggest = max(b.params(c.tp, c.ep) for b, _ in view.blocks)
        gathered = 0.0
        if c.fsdp:
            held = (dense + experts + root) if gathered_whole else (
                2 * biggest + (shape.output_params / c.tp if view.last else 0))
            # Under a pipeline, gradients are reduced once per step: the stage's stay unsharded until then.
            grads = (dense + experts + root) if gathered_whole and c.microbatches > 1 else biggest
            gathered = pbytes * held + (pbytes + grad_extra) * grads
        kept, recompute = 0.0, 0.0
        for b, n in view.blocks:
            k, r = activation_bytes_per_token(b, c.tp, shape.dim, act, c.ac)
            kept += n * k
            recompute = max(recompute, r)
        if c.pp > 1:
            # Each chunk in flight holds one of this rank's stages' activations.
            kept = kept / stages_per_rank * chunks_in_flight(c, view.rank, stages_per_rank)
        activations = tokens * (kept + recompute)
        loss = tokens * shape.vocab / c.tp * (act + 4) if view.last else 0.0  # logits and their fp32 copy
        total = MemoryBreakdown(state, gathered, activations, loss, reserve_gib * GIB)
        if best is None or total.total > best.total:
            best = total
    return best


def _stages_per_rank(c: Candidate) -> int:
    from titanctl.parallel.layouts.pipeline_stages import default_stages_per_rank

    return default_stages_per_rank(c.pp_schedule)

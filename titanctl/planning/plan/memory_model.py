"""The planner's fast memory path: per-rank peak bytes of a layout, from formulas over the model's shapes.

It ranks thousands of layouts in milliseconds; the finalists get ``estimate-memory``'s exact figure
(``search.exact_memory``). The peak is the largest of the moments where memory tops out in a step
(what estimate-memory's engine finds): the loss's backward, the first recomputed block's backward,
and the last block's backward. The terms, per rank (the pipeline rank that holds the most):

- training state: fp32 parameters and Adam's two moments, 12 bytes per parameter this rank holds
  (after TP and EP; under Muon 8 for the blocks' matrices, which keep one momentum buffer, and for
  routed experts with muon_experts), divided by the FSDP degree dp_shard x cp (experts: by the ranks
  that shard them), and fp32 gradients (4 more) once a backward has made them: at the last block's backward,
  or from the second microbatch of an accumulation or a pipeline on; DDP adds its gradient buckets;
- FSDP's gathered copies: at the loss the last block, prefetched; at a block's backward two blocks'
  parameters in the compute dtype (the one running and the one prefetched) and one block's gradients
  before their reduce-scatter (plus an fp32 copy when reduced in fp32); under pipelining parameters
  stay gathered and gradients unsharded for the whole step (``fsdp_reshard_after_forward`` default);
- activations saved for backward, per token and block: what each matmul's backward needs (the linears' outputs
  that later ops keep, the attention output, the SwiGLU product, CP's copies of the rank's keys and values
  (``CP_KV_COPIES``, O(S / cp) under every method: no method gathers the whole sequence's), a Gated
  DeltaNet's chunked delta rule's own tensors, widened under ring and ulysses_ring CP by the scan's d_k value
  columns), the norms' inputs and outputs and their fp32 copies, and under
  TP with sequence parallel the gathered inputs of the column-wise linears; activation checkpointing keeps
  only block inputs (full), every second block's (selective 2), or the attention output and every odd-numbered
  matmul's output (selective op, as its policy saves them), and recomputes one block in backward; an attention
  that materializes its scores (DeepSeek-V4's, ``Block.attention_scores``) keeps its probabilities (unless
  activation checkpointing recomputes them) and holds about three more copies of them in its backward (the
  probabilities' gradient, the softmax's, the masked scores'): measured 3.6-3.8 copies in all for one V4-Flash
  attention layer of 4096 tokens in bf16 (fake tensors, torch's MemTracker), counted as 4;
- blocks in flight: without pipelining one microbatch of every block; under a pipeline the
  microbatches each schedule keeps alive on a rank (1F1B: up to pp; GPipe and LoopedBFS: all of
  them; interleaved: the warm-up's (v - 1) x pp + 2 x (pp - 1) chunks), each with its stage's input
  and output;
- the step's attention masks (``Masks``): none under a causal mask; a document mask or gpt-oss's masks by
  layer type as the documents' starts (O(S)), and under Ulysses and in one process the span kernel's one
  chunk's block (SPAN_CHUNK_ROWS x S) at a time; nothing S x S;
- the loss (rank of the last stage): the logits in the compute dtype and the log-softmax's fp32
  output, two fp32 temporaries of their size in its backward (three under loss parallel), the final
  norm's tensors;
- the device's reserve (CUDA context, communication and matmul workspaces, allocator slack).

A LoRA recipe (``lora.enable``) keeps its frozen base as fp32 parameters only (4 bytes each, sharded as
above): gradients, Adam's moments, DDP's buckets and FSDP's unsharded gradients exist for the adapters
alone (``Adapters``, their parameters per block and on the output layer, taken whole on every rank:
they are small).

Against the exact engine (Llama 3.1 8B and 70B, Qwen3 8B, every AC mode, FSDP, HSDP, TP, CP): within
-6% / +3%; Mixture-of-Experts blocks about 4% below; pipelines hold the busiest rank, the exact
estimate rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanctl.planning.plan.candidates import Candidate
from titanctl.planning.plan.workload import Block, Linear, ModelShape

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
class Adapters:
    """A LoRA recipe's trained parameters: per block (the mean over blocks; routed experts' apart, split
    over EP) and on the output layer; which of a block's linears have one (names inside the block, any
    block's), and their rank."""
    per_block: float
    experts_per_block: float
    output: int
    targets: frozenset[str] = frozenset()
    rank: int = 0

    def on_rank(self, blocks: int, ep: int, last: bool) -> float:
        return blocks * (self.per_block + self.experts_per_block / ep) + (self.output if last else 0)


def adapters_of(args, lora) -> Adapters:
    """The adapters of ``args``' model under the recipe's ``[lora]`` section."""
    import math

    from titanctl.parallel.converters.lora import is_adapter, saved_shapes

    dense = experts = output = 0
    targets = set()
    for name, shape in saved_shapes(args, lora).items():
        if not is_adapter(name):
            continue
        if name.endswith(".lora_a") and name.startswith("layers."):
            targets.add(name.split(".", 2)[2].removesuffix(".lora_a"))
        if name.startswith("output."):
            output += math.prod(shape)
        elif ".experts." in name:
            experts += math.prod(shape)
        else:
            dense += math.prod(shape)
    return Adapters(dense / args.n_layers, experts / args.n_layers, output, frozenset(targets), lora.rank)


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


def forward_order(linears: tuple[Linear, ...]) -> list[Linear]:
    """A block's linears in the order its forward runs them: each sublayer's (attention, feed-forward,
    shared experts) in turn, the one that projects back to the model width (wo, w2) last."""
    sublayers: dict[str, int] = {}
    for lin in linears:
        sublayers.setdefault(lin.name.rpartition(".")[0], len(sublayers))

    def key(lin: Linear) -> tuple[int, bool]:
        return sublayers[lin.name.rpartition(".")[0]], lin.split == "row" or lin.name.endswith((".wo", ".w2"))

    return sorted(linears, key=key)


DELTA_RULE_CHUNK = 64  # the chunk of titanctl's chunked gated delta rule in training


def delta_rule_bytes_per_token(block: Block, tp: int, act: int, scan: bool = False) -> float:
    """Bytes per token that a Gated DeltaNet block saves for its backward beyond its linears' outputs (0 for
    any other block), its heads split over the TP ranks. Per value head, the chunked delta rule's, in fp32:
    5·d_k + 2·d_v (the keys scaled and masked, the solve's outputs, the deltas), 5·C (the chunk's C x C
    decay, system and score rows), d_k·d_v / C (the state at each chunk's start), 5 + 1 / C (decays, beta),
    and under 16-bit activations 2·d_k + d_v more (its chunks-first fp32 copies of q, k and v: under fp32
    ones they stand in for the layer's q, k and v, counted around it); around it, the conv's and the L2
    norms' tensors and the gated RMSNorm's, (3·a + 2)·d_k + (4·a + 6)·d_v bytes per value head and 2·a·d_k
    per key head (a: the activations' bytes). Measured with saved-tensor hooks on the kernel (five head
    shapes; exact but for the final state's slot, d_k·d_v·4 bytes a sequence) and on the layer
    (tests/unit/planning/test_gated_deltanet_planning.py, within its 2%).

    ``scan``: under ring and ulysses_ring CP (linear_attention_cp.py) the rule runs over d_v + d_k value columns
    (zeros widened in, the outputs [o(0) | m] kept for the state's correction): per value head 19·d_k + 8·d_v +
    6·d_k² / C bytes more in fp32, 17·d_k + 6·d_v + 6·d_k² / C under 16-bit activations (fitted to saved-tensor
    hooks on the layer over four head shapes at 1024 tokens; its O(1) a sequence, the chunk maps and states,
    left out). Per token the same under ulysses_ring (1 / u of the heads over u x the positions)."""
    if block.delta_rule is None:
        return 0.0
    key_heads, heads, dk, dv = block.delta_rule
    c = DELTA_RULE_CHUNK
    rule = 4 * (5 * dk + 2 * dv + dk * dv / c + 5 * c + 5 + 1 / c) + (4 * (2 * dk + dv) if act == 2 else 0)
    around = (3 * act + 2) * dk + (4 * act + 6) * dv
    widened = ((17 * dk + 6 * dv if act == 2 else 19 * dk + 8 * dv) + 6 * dk * dk / c) if scan else 0.0
    return (heads * (rule + around + widened) + key_heads * 2 * act * dk) / tp


# Copies of a rank's own key/value shard that CP keeps per block beyond one process's tensors, whatever the method
# and the degree: each method's saved inputs, the masked ring's stacked K/V, the one shard visiting at a time. None
# holds the whole sequence's keys (O(S / cp)). Measured by estimate-memory (torch's ring under a causal mask, the
# masked ring under documents and Ulysses alike): 2.6-2.8 shards per layer for the Llama debug model in fp32 at
# CP 2, 4 and 8, 2.1-2.2 for Llama 3.1 8B in bf16 at CP 2 and 4.
CP_KV_COPIES = 2.5


@dataclass(frozen=True)
class Masks:
    """The attention masks a step builds (``model.attn_mask_type``, gpt-oss's masks by layer type), each kept as
    what defines it: the documents' starts (a ``SpanMask``, or the masked ring's ``RingMask``), never S x S.
    ``with_cp`` / ``without_cp``: whether the step has one under context parallelism / without it (a causal
    mask has none, but gpt-oss's layers take one under CP and attend by spans without: a causal SpanMask)."""
    with_cp: bool = False
    without_cp: bool = False

    def bytes(self, c: Candidate, seq_len: int, act: int) -> float:
        """Bytes a rank holds for them. The masked ring (ring and ulysses_ring): none counted (the starts, and one
        (S / cp)^2 block at a time, freed before the peak). ``span_attention`` (one process, Ulysses: its kernels
        see every query): the starts, 8 bytes a position, and one chunk's block of the mask, SPAN_CHUNK_ROWS x S
        in the kernels' dtype (fp32 or wider), an upper bound: estimate-memory (fake tokens: the causal spans)
        measures it exactly in one process and finds it freed before the peak under Ulysses. Nothing per layer:
        the layers share the starts, and each chunk's block is dropped once attended."""
        from titanctl.models.common.span_attention import SPAN_CHUNK_ROWS

        held = self.with_cp if c.cp > 1 else self.without_cp
        if not held or (c.cp > 1 and c.cp_method != "ulysses"):
            return 0.0
        seqs = c.pp_microbatch_size if c.pp > 1 else c.local_batch_size
        return seqs * seq_len * (8 + min(SPAN_CHUNK_ROWS, seq_len) * max(act, 4))


def masks_of(args, attn_mask_type: str, target: str) -> Masks:
    """The masks of a model (its ModelArgs) under ``attn_mask_type`` on a ``target`` device (cuda/cpu), as
    titanctl/train/attention_masks.py builds them: gpt-oss's masks by layer type under CP and its attention by
    spans without (SpanMasks on every device, causal ones too); a document mask on CPU (a SpanMask), none counted
    on CUDA (a FlexAttention block mask, a few bytes a block)."""
    layered = args.attention_sinks or "sliding_attention" in args.layer_types
    if layered:
        return Masks(with_cp=True, without_cp=True)
    documents = attn_mask_type != "causal" and target == "cpu"
    return Masks(with_cp=documents, without_cp=documents)


def activation_bytes_per_token(block: Block, tp: int, cp: int, dim: int, act: int, ac: str,
                               adapters: Adapters | None = None, scan: bool = False) -> tuple[float, float]:
    """(bytes kept per token by this block until its backward, bytes of one block recomputed in backward).
    ``scan``: a Gated DeltaNet block runs the CP scan (ring, ulysses_ring: ``delta_rule_bytes_per_token``)."""
    outputs = sum(lin.local(tp)[0] for lin in block.linears if lin.split != "row")
    row_inputs = sum(lin.local(tp)[1] for lin in block.linears if lin.split == "row")
    norms = 4 * dim / tp + (2 * dim if tp > 1 else 0)  # in/out of two norms; gathered inputs under SP
    full = outputs + 2 * row_inputs + norms  # row inputs: the tensor and the op that made it (sdpa out, silu x w3)
    if cp > 1:  # keys and values beyond one process's: a few copies of this rank's shard (CP_KV_COPIES)
        full += CP_KV_COPIES * sum(lin.local(tp)[0] for lin in block.linears
                                   if lin.name.endswith((".wk", ".wv", ".wkv_b")))
    # A 16-bit run's norms compute in fp32: their fp32 input copies stay too (as 4-byte elements).
    full += 2 * 2 * dim / tp if act == 2 else 0.0
    if block.experts is not None:
        e = block.experts
        per_routed = sum(o for o, _ in e.matrices) + 2 * e.matrices[1][1]
        # Per token of the whole sequence: under TP each rank runs the MoE layer on all of it;
        # the dispatched copies of the token for each of its top_k experts, there and back.
        full += e.top_k * (per_routed + 2 * dim)
    block_input = dim / tp if tp > 1 else dim
    kept = {
        "none": full,
        "selective_op": block_input + _op_level_saved(block, tp, dim, adapters),
        "selective_2": (full + block_input) / 2,
        "full": block_input,
    }[ac]
    recompute = 0.0 if ac in ("none", "selective_op") else full
    # The Gated DeltaNet's own tensors (batched matmuls, solves, elementwise ops): op-level AC saves none of
    # them (its policy saves mm and attention), so they exist only while the block's backward recomputes them.
    rule = delta_rule_bytes_per_token(block, tp, act, scan)
    rule_kept = {"none": rule, "selective_op": 0.0, "selective_2": rule / 2, "full": 0.0}[ac]
    # Materialized attention scores: the probabilities stay for backward (op-level AC saves the score matmul's
    # output as it saves every mm's), about three more copies exist while its backward runs.
    scores = block.scores(cp) / tp
    scores_kept = {"none": scores, "selective_op": scores, "selective_2": scores / 2, "full": 0.0}[ac]
    scores_backward = 4 * scores - scores_kept
    return ((kept + scores_kept) * act + rule_kept,
            (recompute + scores_backward) * act + (0.0 if ac == "none" else rule))


def _op_level_saved(block: Block, tp: int, dim: int, adapters: Adapters | None = None) -> float:
    """Elements per token that op-level selective AC keeps: every odd-numbered matmul's output in
    forward order (the count restarts in each block; a row-wise linear's partial sums are model-wide;
    a linear with a LoRA adapter runs three: its own, A's (rank wide) and B's), the attention's
    output, and under sequence parallelism the reduce-scatters' outputs."""
    outputs = []
    for lin in forward_order(block.linears):
        width = dim if lin.split == "row" else lin.local(tp)[0]
        outputs.append(width)
        if adapters is not None and lin.name in adapters.targets:
            outputs += [adapters.rank, width]
    saved = float(sum(width for i, width in enumerate(outputs) if i % 2 == 0))
    attention_out = next((lin.local(tp)[1] for lin in block.linears if lin.name.endswith(".wo")), 0)
    reduce_scatters = 2 * dim / tp if tp > 1 else 0
    return saved + attention_out + reduce_scatters


def estimate(shape: ModelShape, ranks: Ranks, c: Candidate, *, seq_len: int, param_dtype: str,
             reduce_dtype: str, reshard_after_forward: str, reserve_gib: float,
             loss_parallel: bool = True, after_rank0: bool = False,
             adapters: Adapters | None = None, optimizer: str = "AdamW",
             muon_experts: bool = False, masks: Masks = Masks()) -> MemoryBreakdown | None:
    """The fast estimate of the peak of the pipeline rank that holds the most (``after_rank0``: of the
    ranks after rank 0, None without a pipeline): the largest of the loss's backward (the last stage:
    every block's activations and the logits' tensors), the first recomputed block's backward and the
    last block's (every gradient made). ``adapters``: a LoRA recipe's (see the module docstring).
    ``optimizer``/``muon_experts``: optimizer.name and optimizer.muon_experts (Muon's state is smaller).
    ``masks``: the step's dense attention masks (``masks_of``), alive for the whole step."""
    act = _dtype_bytes(param_dtype)
    pbytes = _dtype_bytes(param_dtype)
    grad_bytes = 4 if reduce_dtype == "float32" else pbytes  # FSDP's unsharded gradients, in the reduce dtype
    grad_extra = 4 if reduce_dtype == "float32" and pbytes == 2 else 0
    shard = c.dp_shard * c.cp if c.fsdp else 1
    expert_shard = max(1, c.dp_shard * c.cp // c.ep) if c.fsdp else 1
    gathered_whole = c.pp > 1 if reshard_after_forward == "default" else reshard_after_forward == "never"
    # FSDP under a pipeline keeps parameters gathered and gradients unsharded until the step's end.
    whole_stage = c.fsdp and gathered_whole
    # Sharded fp32 gradients exist at the loss once a backward made them: with accumulation, or a
    # pipeline's later microbatches (the first microbatch's loss comes before any).
    accumulating = c.grad_accum > 1 or (c.microbatches > 1 and not whole_stage)
    tokens = (c.pp_microbatch_size if c.pp > 1 else c.local_batch_size) * seq_len / c.cp
    stages_per_rank = 1 if c.pp == 1 else _stages_per_rank(c)
    # Logits (compute dtype) and the log-softmax's fp32 output stay for the loss's backward, which
    # adds two fp32 temporaries of the same size (three under loss parallel: DTensor's shards).
    loss_bytes = act + 4 + (12 if c.tp > 1 and loss_parallel else 8)
    vocab = shape.vocab / c.tp if loss_parallel else shape.vocab
    # The final norm's input, output and their fp32 copies (on the sequence shard under TP), and the
    # output layer's all-gathered input.
    final_norm = ((2 * act + (8 if act == 2 else 0)) / c.tp + (act if c.tp > 1 else 0)) * shape.dim
    best = None
    for view in ranks.views(c.pp, c.pp_schedule):
        if after_rank0 and view.rank == 0:
            continue
        dense = sum(n * (b.params(c.tp, c.ep) - b.expert_params(c.ep)) for b, n in view.blocks)
        experts = sum(n * b.expert_params(c.ep) for b, n in view.blocks)
        root = (shape.embedding_params / c.tp if view.first else 0) + (
            (shape.output_params / c.tp + shape.final_norm_params) if view.last else 0)
        stage = dense + experts + root
        stored = (dense + root) / shard + experts / expert_shard
        biggest = max(b.params(c.tp, c.ep) for b, _ in view.blocks)
        # What trains: every parameter, or a LoRA recipe's adapters (its frozen base: fp32 parameters only).
        trained, trained_stored, trained_block, frozen_stored = stage, stored, biggest, 0.0
        # Muon keeps one momentum buffer (4 bytes) where Adam keeps two moments (8): the blocks' matrices
        # (their norms are too small to count), and the routed experts with muon_experts.
        muon_stored = 0.0
        if optimizer == "Muon" and adapters is None:
            muon_stored = dense / shard + (experts / expert_shard if muon_experts else 0.0)
        if adapters is not None:
            trained = adapters.on_rank(sum(n for _, n in view.blocks), c.ep, view.last)
            trained_stored = trained / shard
            trained_block = adapters.per_block + adapters.experts_per_block / c.ep
            frozen_stored = stored
        # fp32 parameters and Adam's two moments, and the gradients once they exist.
        state = 4 * frozen_stored + 12 * trained_stored - 4 * muon_stored + (4 * trained_stored if accumulating else 0)
        if c.ddp:
            state += 4 * trained  # the gradient buckets
        # FSDP's unsharded parameters and gradients at the loss and at a block's backward.
        at_loss = at_block = 0.0
        if whole_stage:
            at_loss = at_block = pbytes * stage + (grad_bytes * trained if c.microbatches > 1 else 0)
        elif c.fsdp:
            at_loss = pbytes * biggest  # the last block, prefetched for its backward
            at_block = 2 * pbytes * biggest + (pbytes + grad_extra) * trained_block
        mask = masks.bytes(c, seq_len, act)
        kept, recompute, one_block = 0.0, 0.0, 0.0
        scan = c.cp > 1 and c.cp_method != "ulysses"  # Gated DeltaNet's prefix scan over the ranks (or groups)
        for b, n in view.blocks:
            k, r = activation_bytes_per_token(b, c.tp, c.cp, shape.dim, act, c.ac, adapters, scan)
            kept += n * k
            recompute = max(recompute, r)
            one_block = max(one_block, k)
        if c.pp > 1:
            # Each chunk in flight holds one of this rank's stages' activations, and the stage's input and
            # output (received and sent, sequence-sharded under TP) until its backward.
            per_chunk = kept / stages_per_rank + 2 * shape.dim / c.tp * act
            kept = per_chunk * chunks_in_flight(c, view.rank, stages_per_rank)
        candidates = [MemoryBreakdown(state, at_block, tokens * (kept + recompute) + mask, 0.0, reserve_gib * GIB)]
        if not accumulating and not whole_stage:
            # The last block's backward: one block's activations left, every gradient made.
            candidates.append(MemoryBreakdown(state + 4 * trained_stored, at_block,
                                              tokens * (one_block + recompute) + mask, 0.0, reserve_gib * GIB))
        if view.last:
            candidates.append(MemoryBreakdown(state, at_loss, tokens * kept + mask,
                                              tokens * (vocab * loss_bytes + final_norm), reserve_gib * GIB))
        for total in candidates:
            if best is None or total.total > best.total:
                best = total
    return best


def _stages_per_rank(c: Candidate) -> int:
    from titanctl.parallel.layouts.pipeline_stages import default_stages_per_rank

    return default_stages_per_rank(c.pp_schedule)

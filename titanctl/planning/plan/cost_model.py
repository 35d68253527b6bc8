"""Seconds per optimizer step of a layout on a device, term by term (docs/memory-and-planning.md explains each).

Compute, per block and microbatch on one rank:
- matmuls: every linear's forward and its two backward matmuls (input and weight gradients), each
  timed as max(FLOPs / (peak x efficiency(M, N, K)), bytes moved / memory bandwidth), where
  efficiency = matmul_efficiency (Float8 linears: float8_matmul_efficiency of the fp8 peak)
  x prod(x / (x + matmul_half_dim)) over the three dims: small dims
  (a TP-split head, a short microbatch, few tokens per expert) fill the device's tiles poorly;
- attention: the FLOPs the model counts for it (spec.flops_per_token minus 6 x active parameters) /
  (peak x attention_efficiency); under ring and ulysses_ring CP a Gated DeltaNet block's scan runs its chunked
  rule with the values widened by key_dim zero columns: the FLOPs that widening adds (the family's count with
  d_v + d_k value columns, less its own) at the same efficiency;
- elementwise work (norms, RoPE, SwiGLU, residuals, layout copies): bytes read and written /
  memory bandwidth; compile fuses them (about 40% of eager's traffic);
- activation checkpointing recomputes forwards: full every block's, selective 2 every second
  block's, selective op the elementwise work and half the matmuls;
- host time per kernel launched: GPUs queue kernels ahead (time = max(device, host)), a CPU runs
  them in turn (time = device + host); DTensor adds host time to TP's split linears and sequence-
  parallel norms and to CP's ring attention calls (measured by --calibrate);
- the output layer and the loss (logits in fp32), the embedding; per step, the optimizer
  (AdamW reads and writes 28 bytes per local parameter) and gradient clipping;
- every compute term above times the device's ``compute_scale``: 1 for presets; measured by --calibrate
  (a whole training step of a small model against this sum for it).

Communication, each collective timed over the link its ranks share (within a node, or across the
network: a group whose ranks span nodes runs at the network's speed) as latency x steps + bytes x
(n - 1) / n / bandwidth (ring all-gather, reduce-scatter, all-to-all; twice for all-reduce):
- FSDP: per block, an all-gather of its parameters in the compute dtype (float8 with float8
  all-gathers) before forward and again before backward, a reduce-scatter of its gradients in
  backward (under a pipeline: once per step); prefetching hides them behind the neighbouring block's
  compute (``overlap`` of what fits), except the first all-gather and the last reduce-scatter;
  HSDP adds an all-reduce of the sharded gradients over the replicas; DDP an all-reduce of all
  gradients, bucketed behind backward;
- TP with sequence parallel: two all-gathers and two reduce-scatters of the block's activations
  forward, the same backward (and again for recomputed forwards); exposed, but for the share
  ``async_tp_overlap`` x ``overlap`` that async TP hides behind its split matmuls;
- CP: ring: all-gathers of keys and of values forward and backward, reduce-scatters of their gradients;
  under a mask (documents, windows, sinks) the masked ring instead: cp - 1 point-to-point shifts of the rank's
  K/V shard forward (again for a recomputed forward), and of the shard and its dK/dV partials backward, without
  DTensor's host time (every block counted: the plan does not know where documents fall);
  Ulysses: all-to-alls of q, k, v and the output forward, of their gradients backward (recomputed
  forwards again), and none of the ring's DTensor host time;
  ulysses_ring (u Ulysses ranks inside a node, a ring of cp / u groups): Ulysses' all-to-alls over the u ranks
  (at the node's bandwidth), then the masked ring (causal masks too) over the cp / u groups: cp / u - 1 shifts
  of the group's K/V for 1 / u of the heads (as many bytes as the rank's own shard), over the ring's link;
  Gated DeltaNet blocks instead: under Ulysses 2 all-to-alls forward (conv_dim + 2 H_v per token, then value_dim)
  and 2 backward; under ring the prefix scan's all-gathers of each chunk's state map and of the conv's halo,
  reduce-scattered backward; under ulysses_ring both: the all-to-alls over the u ranks, then the scan over the
  cp / u groups for H_v / u heads;
- EP: all-to-all dispatch and combine of each MoE layer's routed tokens, forward and backward;
- PP: point-to-point sends of activations and gradients at every stage boundary.

Pipelines: (microbatches x the slowest rank's time per microbatch) + bubble, where the bubble is
(pp - 1) stage-times for GPipe and 1F1B, (pp - 1) / v for the interleaved schedules (v stages per
rank), a third of that for InterleavedZeroBubble (weight gradients fill the rest) and a sixth for
the V-shaped zero-bubble schedules; the fill and drain also wait for (pp - 1) hops of sends.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from dataclasses import dataclass, field

from titanctl.planning.plan.candidates import Candidate
from titanctl.planning.plan.devices import Device
from titanctl.planning.plan.memory_model import Ranks, RankView
from titanctl.planning.plan.workload import Block, ModelShape

COMPILED_TRAFFIC = 0.4  # share of eager's elementwise traffic left after inductor fuses a block


@dataclass
class StepTime:
    compute: float = 0.0  # seconds of compute on the busiest rank (recompute and optimizer included)
    exposed_comm: float = 0.0  # communication not hidden behind compute
    bubble: float = 0.0  # pipeline fill and drain
    comm_total: float = 0.0  # every collective's time, hidden or not
    terms: dict[str, float] = field(default_factory=dict)  # seconds per named term (see module docstring)

    @property
    def step(self) -> float:
        return self.compute + self.exposed_comm + self.bubble

    @property
    def dominant(self) -> str:
        parts = {"compute": self.compute, "exposed communication": self.exposed_comm, "bubble": self.bubble}
        return max(parts, key=parts.get)

    def add(self, term: str, seconds: float) -> None:
        self.terms[term] = self.terms.get(term, 0.0) + seconds


@dataclass(frozen=True)
class Setting:
    """What the cost of a block depends on beyond the candidate's degrees."""
    device: Device
    dtype: str  # compute dtype: bfloat16 / float16 / float32
    seq_len: int
    attention_flops_per_token_layer: float  # forward + backward, as the model counts them
    kv_width: int  # key + value channels per token (all heads)
    q_width: int = 0  # query channels per token (all heads): Ulysses sends them, and the output as wide
    masked: bool = False  # attention under a mask (documents, sliding windows, sinks): ring CP runs the masked ring
    # Forward + backward FLOPs per token that the CP scan adds to one Gated DeltaNet layer's chunked rule (ring and
    # ulysses_ring: its values widened by key_dim zero columns, linear_attention_cp.py), as the model counts them
    scan_widening_flops_per_token: float = 0.0

    @classmethod
    def of_model(cls, device: Device, dtype: str, args, seq_len: int, attn_mask_type: str = "causal") -> Setting:
        """The setting of a model (its ModelArgs) at ``seq_len`` tokens per sequence under ``attn_mask_type``."""
        from titanctl.models.common.flops import active_params
        from titanctl.models.registry import spec_of

        attention = (spec_of(args).flops_per_token(args, seq_len) - 6 * active_params(args)) / args.n_layers
        mla = args.mla
        kv = args.n_heads * (mla.qk_head_dim + mla.v_head_dim) if mla is not None else 2 * args.kv_heads * args.head_dim
        q = args.n_heads * (mla.qk_head_dim if mla is not None else args.head_dim)
        masked = attn_mask_type != "causal" or args.attention_sinks or "sliding_attention" in args.layer_types
        return cls(device, dtype, seq_len, attention, kv, q, masked, scan_widening_flops(args, seq_len))


def scan_widening_flops(args, seq_len: int) -> float:
    """Forward + backward FLOPs per token that the CP scan adds to one Gated DeltaNet layer (0 without them): the
    family's count of its kernel (``flops_per_token`` less 6 x active parameters) with each value head widened by
    key_head_dim columns, less the plain count, per layer."""
    from titanctl.models.common.flops import active_params
    from titanctl.models.registry import spec_of

    la = args.linear_attention
    layers = sum(args.is_linear_attention_layer(i) for i in range(args.n_layers))
    if la is None or not layers:
        return 0.0
    widened = args.replace(linear_attention=dataclasses.replace(la, value_head_dim=la.value_head_dim + la.key_head_dim))
    flops = spec_of(args).flops_per_token

    def kernels(a) -> float:
        return flops(a, seq_len) - 6 * active_params(a)

    return (kernels(widened) - kernels(args)) / layers


def collective_time(device: Device, kind: str, nbytes: float, n: int, inter_node: bool) -> float:
    """Ring-algorithm time of one collective over ``n`` ranks; ``nbytes``: the whole (gathered) tensor."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    link = device.link(kind, inter_node)
    bandwidth = link.gbps * 1e9
    latency = link.latency_us * 1e-6
    if kind == "p2p":
        return latency + nbytes / bandwidth
    steps = n - 1
    factor = 2 if kind == "all_reduce" else 1
    return factor * (steps * latency + steps / n * nbytes / bandwidth)


def spans_nodes(device: Device, stride: int, size: int) -> bool:
    """Whether a mesh dimension of ``size`` ranks ``stride`` apart leaves a node."""
    return stride * size > device.gpus_per_node


class CostModel:
    def __init__(self, shape: ModelShape, setting: Setting):
        self.shape = shape
        self.s = setting
        self.device = setting.device

    # ------------------------------------------------------------------------------- kernels

    @functools.cache  # noqa: B019 (one model per search; shapes repeat across layouts)
    def matmul(self, m: int, n: int, k: int, float8: bool) -> float:
        d = self.device
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        peak = d.peak_tflops(self.s.dtype, float8) * 1e12
        half = d.matmul_half_dim
        efficiency = (d.float8_matmul_efficiency if float8 and d.peak_fp8_tflops else d.matmul_efficiency)
        efficiency *= (m / (m + half)) * (n / (n + half)) * (k / (k + half))
        elem = 1 if float8 else (4 if self.s.dtype == "float32" else 2)
        flops_time = 2 * m * n * k / (peak * efficiency)
        bytes_time = elem * (m * k + k * n + m * n) / (d.memory_bandwidth_gbps * 1e9)
        return max(flops_time, bytes_time)

    def linear_fwd_bwd(self, m: int, out_f: int, in_f: int, float8: bool) -> tuple[float, float]:
        fwd = self.matmul(m, out_f, in_f, float8)
        bwd = self.matmul(m, in_f, out_f, float8) + self.matmul(out_f, in_f, m, float8)
        return fwd, bwd

    def elementwise(self, nbytes: float) -> float:
        return nbytes / (self.device.memory_bandwidth_gbps * 1e9)

    def host(self, kernels: float) -> float:
        return kernels * self.device.op_overhead_us * 1e-6

    # ------------------------------------------------------------------------------- one block

    @functools.cache  # noqa: B019
    def block(self, block: Block, tokens: int, tp: int, cp: int, ep: int, compiled: bool, float8: bool
              ) -> tuple[float, float, float, float]:
        """(forward device time, backward device time, forward host time, backward host time) of one
        block for ``tokens`` tokens of a sequence shard (tokens = microbatch x seq_len / cp)."""
        dim = self.shape.dim
        elem = 4 if self.s.dtype == "float32" else 2
        fwd = bwd = 0.0
        kernels = 0
        for lin in block.linears:
            out_f, in_f = lin.local(tp)
            moe_whole = lin.name.startswith("moe.")
            f, b = self.linear_fwd_bwd(tokens, out_f, in_f, float8 and not moe_whole)
            fwd, bwd = fwd + f, bwd + b
            kernels += 1
        if block.experts is not None:
            e = block.experts
            local = e.count // ep
            per_expert = max(1, round(tokens * e.top_k * ep / e.count))
            for out_f, in_f in e.matrices:
                f, b = self.linear_fwd_bwd(per_expert, out_f, in_f, False)
                fwd, bwd = fwd + local * f, bwd + local * b
            kernels += 3 + 8  # grouped matmuls, routing, sorting, gathers
            traffic_moe = tokens * e.top_k * dim * elem * 6  # permute, un-permute, weighting
        else:
            traffic_moe = 0.0
        attention = self.s.attention_flops_per_token_layer * tokens / tp
        peak = self.device.peak_tflops(self.s.dtype) * 1e12
        attn_time = attention / (peak * self.device.attention_efficiency)
        fwd += attn_time / 3
        bwd += attn_time * 2 / 3
        # Elementwise traffic per token, forward (in elements): two norms (eager: ~5 read+write passes
        # each over the sequence-parallel shard), RoPE and head transposes over the projections'
        # outputs, SwiGLU and the attention output over the row-wise inputs, two residual adds.
        col_out = sum(lin.local(tp)[0] for lin in block.linears if lin.split != "row")
        row_in = sum(lin.local(tp)[1] for lin in block.linears if lin.split == "row")
        per_token = 2 * 10 * dim / tp + 2 * col_out + 3 * row_in + 6 * dim / tp
        traffic = tokens * per_token * elem + traffic_moe
        if float8:
            traffic += tokens * (col_out + row_in) * elem  # casting inputs (amax, scale)
        if compiled:
            traffic *= COMPILED_TRAFFIC
        fwd += self.elementwise(traffic)
        bwd += self.elementwise(2 * traffic)
        # Kernels: eager runs ~24 elementwise kernels per block forward besides the matmuls (twice
        # as many backward); compile fuses them into a handful.
        fwd_kernels = kernels + (6 if compiled else 24)
        return fwd, bwd, self.host(fwd_kernels), self.host(2 * fwd_kernels)

    # ------------------------------------------------------------------------------- context parallel

    def cp_exchange(self, b: Block, c: Candidate, seqs: int, tokens: int, recompute: float
                    ) -> list[tuple[str, float]]:
        """(term, seconds) of one block's context-parallel communication per microbatch (all exposed: the next
        kernel waits on it). ``tokens``: this rank's, seqs x seq_len / cp; ``recompute``: forwards AC reruns."""
        d = self.device
        elem = 4 if self.s.dtype == "float32" else 2
        cp_inter = spans_nodes(d, c.tp, c.cp)
        if b.delta_rule is not None:
            return self._delta_rule_exchange(b, c, seqs, tokens, recompute, elem, cp_inter)
        if c.cp_method in ("ulysses", "ulysses_ring"):
            # q, k, v to head shards and the output back forward; their gradients the other way backward
            # (ulysses_ring: over its u innermost CP ranks only)
            hybrid = c.cp_method == "ulysses_ring"
            u = c.cp_ulysses if hybrid else c.cp
            qkvo = tokens * (2 * self.s.q_width + self.s.kv_width) / c.tp * elem
            out = [("cp ulysses all-to-alls",
                    (2 + recompute) * collective_time(d, "all_to_all", qkvo, u, spans_nodes(d, c.tp, u)))]
            if hybrid:  # then the masked ring over the cp / u groups (ranks tp x u apart) for H / u heads:
                # the group's u x T / cp positions of 1 / u of the heads, as many bytes as a rank's shard
                ring = c.cp // u
                shard = tokens * self.s.kv_width / c.tp * elem
                out.append(("cp masked ring sends", (ring - 1) * (3 + recompute) * collective_time(
                    d, "p2p", shard, 2, spans_nodes(d, c.tp * u, ring))))
            return out
        if self.s.masked:
            # The masked ring: at each of cp - 1 steps this rank's K/V shard (keys and values side by side)
            # goes point to point to the rank whose queries see it, forward (again for a recomputed forward),
            # and in backward again with each block's dK/dV partial sent back to its owner. The blocks a
            # mask leaves empty are not sent; where documents fall is the data's, so every block counts.
            shard = tokens * self.s.kv_width / c.tp * elem
            return [("cp masked ring sends",
                     (c.cp - 1) * (3 + recompute) * collective_time(d, "p2p", shard, 2, cp_inter))]
        # keys and values (each) gathered forward and backward, their gradients reduce-scattered
        kv = tokens * c.cp * self.s.kv_width / 2 / c.tp * elem
        return [("cp ring exchange", 2 * (2 * collective_time(d, "all_gather", kv, c.cp, cp_inter)
                                          + collective_time(d, "reduce_scatter", kv, c.cp, cp_inter)))]

    def _delta_rule_exchange(self, b: Block, c: Candidate, seqs: int, tokens: int, recompute: float, elem: int,
                             cp_inter: bool) -> list[tuple[str, float]]:
        """A Gated DeltaNet block's CP traffic (docs/parallelism.md). Under Ulysses (ulysses_ring: over its u
        innermost CP ranks): an all-to-all of the conv's inputs and b, a (conv_dim + 2 H_v per token) to key-head
        shards, one of the rule's output (value_dim) back, forward, and of their gradients backward. Under ring (over
        all cp ranks) and ulysses_ring (over its cp / u groups, for the group's H_v / u heads): the prefix scan's
        all-gathers of every chunk's (M, B) (2 x groups x heads x d_k x (d_k + d_v) fp32 numbers a sequence) and of
        the conv's halo (2 x groups x (K - 1) rows of the conv's channels), forward, reduce-scattered backward."""
        d = self.device
        key_heads, heads, dk, dv = b.delta_rule
        conv_dim = 2 * key_heads * dk + heads * dv
        out = []
        u = 1  # the Ulysses ranks that split the heads before the scan
        if c.cp_method in ("ulysses", "ulysses_ring"):
            u = c.cp_ulysses if c.cp_method == "ulysses_ring" else c.cp
            per_token = conv_dim + 2 * heads + heads * dv
            moved = tokens * per_token / c.tp * elem
            out.append(("cp ulysses all-to-alls (gated deltanet)",
                        (2 + recompute) * collective_time(d, "all_to_all", moved, u, spans_nodes(d, c.tp, u))))
            if c.cp_method == "ulysses":
                return out
        groups = c.cp // u  # the scan's ranks: every CP rank (ring), or one per Ulysses group, tp x u apart
        inter = spans_nodes(d, c.tp * u, groups)
        states = seqs * 2 * groups * heads / (c.tp * u) * dk * (dk + dv) * 4
        halo = seqs * 2 * groups * (self.shape.args.linear_attention.conv_kernel - 1) * conv_dim / (c.tp * u) * elem
        seconds = sum((1 + recompute) * collective_time(d, "all_gather", n, groups, inter)
                      + collective_time(d, "reduce_scatter", n, groups, inter) for n in (states, halo))
        return [*out, ("cp gated deltanet scan", seconds)]

    def scan_widening(self, b: Block, c: Candidate, tokens: int) -> tuple[float, float]:
        """(forward, backward) device seconds that the CP scan's widened values add to a Gated DeltaNet block's
        chunked rule per microbatch (ring and ulysses_ring; 0 otherwise): ``Setting.scan_widening_flops_per_token``
        over this rank's tokens x heads (ulysses_ring: u x the tokens, 1 / u of the heads), at attention's
        efficiency, split 1 : 2 as the block's attention is."""
        if b.delta_rule is None or c.cp == 1 or c.cp_method == "ulysses":
            return 0.0, 0.0
        flops = self.s.scan_widening_flops_per_token * tokens / c.tp
        seconds = flops / (self.device.peak_tflops(self.s.dtype) * 1e12 * self.device.attention_efficiency)
        return seconds / 3, seconds * 2 / 3

    # ------------------------------------------------------------------------------- the step

    def step_time(self, c: Candidate, ranks: Ranks, param_dtype_bytes: int, reduce_dtype_bytes: int,
                  reshard_after_forward: str) -> StepTime:
        d = self.device
        shape = self.shape
        out = StepTime()
        seqs = c.pp_microbatch_size if c.pp > 1 else c.local_batch_size
        tokens = seqs * self.s.seq_len // c.cp
        elem = 4 if self.s.dtype == "float32" else 2
        # Whether each mesh dim's groups leave a node (dims pp, dp_replicate, dp_shard, cp, tp: innermost last).
        fsdp_n = c.dp_shard * c.cp
        tp_inter = spans_nodes(d, 1, c.tp)
        fsdp_inter = spans_nodes(d, c.tp, fsdp_n)
        rep_inter = spans_nodes(d, c.tp * fsdp_n, c.dp_replicate)
        ep_inter = spans_nodes(d, c.tp * (fsdp_n // c.ep), c.ep)
        pp_inter = spans_nodes(d, c.tp * fsdp_n * c.dp_replicate, c.pp)
        gathered_whole = c.pp > 1 if reshard_after_forward == "default" else reshard_after_forward == "never"
        hides = d.overlap
        v = 1 if c.pp == 1 else _stages(c)
        # Forwards recomputed in backward: full AC all of it, selective 2 every second block's, op-level
        # selective AC the elementwise work and the unsaved half of the matmuls (about half a forward).
        recompute = {"none": 0.0, "selective_op": 0.5, "selective_2": 0.5, "full": 1.0}[c.ac]
        tp_forwards = 1 + {"none": 0.0, "selective_op": 0.0, "selective_2": 0.5, "full": 1.0}[c.ac]

        per_view = []  # per microbatch, of each rank viewed: (compute, exposed, comm, terms, view)
        for view in ranks.views(c.pp, c.pp_schedule):
            terms: dict[str, float] = {}
            compute = exposed = comm = 0.0

            def term(name, seconds, terms=terms):
                terms[name] = terms.get(name, 0.0) + seconds

            for b, count in view.blocks:
                f, bw, hf, hb = self.block(b, tokens, c.tp, c.cp, c.ep, c.compile, c.float8)
                device_time = f * (1 + recompute) + bw
                widen_f, widen_b = self.scan_widening(b, c, tokens)
                widening = widen_f * (1 + recompute) + widen_b
                # FSDP's hooks run a dozen host-side operations per block (copy-in/out, waits).
                host_time = hf * (1 + recompute) + hb + (self.host(12) if c.fsdp else 0.0)
                if c.tp > 1:
                    # DTensor's host time: each split linear (forward and backward) and the sequence-parallel
                    # norms' elementwise ops (~6 per norm forward, twice that backward).
                    split = sum(lin.split != "" for lin in b.linears)
                    dtensor = (split * d.dtensor_linear_us + 2 * 18 * d.dtensor_op_us) * 1e-6 * (1 + recompute)
                    host_time += dtensor
                    if not d.host_runs_ahead:  # on GPUs it hides behind the kernels it queues
                        term("tp DTensor host time", count * dtensor)
                if c.cp > 1 and c.cp_method == "ring" and not self.s.masked and b.delta_rule is None:
                    # The ring: 2 cp attention calls forward and 4 cp backward, each with DTensor dispatch.
                    ring = 6 * c.cp * d.dtensor_op_us * 1e-6 * (1 + recompute)
                    host_time += ring
                    if not d.host_runs_ahead:
                        term("cp ring host time", count * ring)
                def on_device(seconds: float, host_time: float = host_time) -> float:
                    busy = max(seconds, host_time) if d.host_runs_ahead else seconds + host_time
                    return busy * d.compute_scale

                block_compute = on_device(device_time + widening)
                widening = block_compute - on_device(device_time)  # what the widened values add to the block
                block_exposed = block_comm = 0.0
                if c.tp > 1:  # 2 all-gathers + 2 reduce-scatters of the activations per forward, same backward
                    gather = tokens * shape.dim * (1 if c.float8 else elem)
                    one = (collective_time(d, "all_gather", gather, c.tp, tp_inter)
                           + collective_time(d, "reduce_scatter", tokens * shape.dim * elem, c.tp, tp_inter))
                    tp_comm = 2 * one * (tp_forwards + 1)
                    tp_exposed = tp_comm * (1 - d.async_tp_overlap * hides) if c.async_tp else tp_comm
                    block_comm += tp_comm
                    block_exposed += tp_exposed
                    term("tp collectives (exposed)", count * tp_exposed)
                if c.cp > 1:
                    for name, seconds in self.cp_exchange(b, c, seqs, tokens, recompute):
                        block_comm += seconds
                        block_exposed += seconds
                        term(name, count * seconds)
                if b.experts is not None and c.ep > 1:  # dispatch and combine, forward and backward
                    routed = tokens * b.experts.top_k * shape.dim * elem * c.ep
                    ep_comm = 4 * collective_time(d, "all_to_all", routed, c.ep, ep_inter)
                    block_comm += ep_comm
                    block_exposed += ep_comm
                    term("ep all-to-all", count * ep_comm)
                params = b.params(c.tp, c.ep)
                if c.fsdp:  # hidden behind the neighbouring block's compute, up to ``overlap``
                    ag = collective_time(d, "all_gather", params * (1 if c.float8 else param_dtype_bytes),
                                         fsdp_n, fsdp_inter)
                    rs = collective_time(d, "reduce_scatter", params * reduce_dtype_bytes, fsdp_n, fsdp_inter)
                    per_mb = (ag + rs) / c.microbatches if gathered_whole else 2 * ag + rs
                    if c.dp_replicate > 1:
                        ar = collective_time(d, "all_reduce", params * reduce_dtype_bytes / fsdp_n,
                                             c.dp_replicate, rep_inter)
                        per_mb += ar / c.microbatches if gathered_whole else ar
                    hidden = hides * min(per_mb, block_compute)
                    block_comm += per_mb
                    block_exposed += per_mb - hidden
                    term("fsdp collectives (exposed)", count * (per_mb - hidden))
                elif c.ddp:  # bucketed all-reduce behind backward
                    ar = collective_time(d, "all_reduce", params * 4, c.dp_replicate, rep_inter)
                    hidden = hides * min(ar, bw)
                    block_comm += ar
                    block_exposed += ar - hidden
                    term("ddp all-reduce (exposed)", count * (ar - hidden))
                compute += count * block_compute
                exposed += count * block_exposed
                comm += count * block_comm
                term("compute: blocks", count * (block_compute - widening))
                if widening:
                    term("compute: gated deltanet scan (widened values)", count * widening)
            if c.fsdp:  # the first all-gather and the last reduce-scatter have nothing to hide behind
                params = view.blocks[0][0].params(c.tp, c.ep)
                edge = (collective_time(d, "all_gather", params * param_dtype_bytes, fsdp_n, fsdp_inter)
                        + collective_time(d, "reduce_scatter", params * reduce_dtype_bytes, fsdp_n, fsdp_inter))
                edge = hides * edge / (c.microbatches if gathered_whole else 1)
                exposed += edge
                term("fsdp collectives (exposed)", edge)
            if view.last:
                out_f = shape.vocab // c.tp
                f, bw = self.linear_fwd_bwd(tokens, out_f, shape.dim, False)
                loss = (f + bw + self.elementwise(tokens * out_f * 4 * 6) + self.host(30)) * d.compute_scale
                compute += loss
                term("compute: output and loss", loss)
            if view.first:
                emb = (self.elementwise(tokens * shape.dim * elem * 3) + self.host(6)) * d.compute_scale
                compute += emb
                term("compute: embedding", emb)
            if c.pp > 1:  # sends of activations forward and gradients backward, per stage held
                p2p = 2 * v * collective_time(d, "p2p", tokens * shape.dim * elem / c.tp, 2, pp_inter)
                exposed += p2p * (1 - 0.5 * hides)
                comm += p2p
                term("pp send/recv (exposed)", p2p * (1 - 0.5 * hides))
            per_view.append((compute, exposed, comm, terms, view))

        busiest = max(per_view, key=lambda p: p[0] + p[1])
        compute, exposed, comm, terms, view = busiest
        shared_cores = c.pp > 1 and d.cores_per_process < 1
        if shared_cores:
            # Processes share the host's cores: while a rank waits, the others run faster, so the ranks'
            # mean work (every core busy) is what the step costs at least; the bubble below adds the rest.
            compute, exposed, comm = (statistics.fmean(p[i] for p in per_view) for i in range(3))
            terms = {name: statistics.fmean(p[3].get(name, 0.0) for p in per_view)
                     for name in {name for p in per_view for name in p[3]}}
        runs = c.grad_accum * c.microbatches  # microbatches this rank runs per optimizer step
        out.compute, out.exposed_comm, out.comm_total = compute * runs, exposed * runs, comm * runs
        for name, seconds in terms.items():
            out.add(name, seconds * runs)
        if c.pp > 1:
            chunk = (busiest[0] + busiest[1]) / v
            factor = {"GPipe": 1.0, "1F1B": 1.0, "Interleaved1F1B": 1.0, "LoopedBFS": 1.0,
                      "InterleavedZeroBubble": 1 / 3, "ZBVZeroBubble": 1 / 6, "DualPipeV": 1 / 6}[c.pp_schedule]
            hops = 2 * (c.pp - 1) * collective_time(d, "p2p", tokens * shape.dim * elem / c.tp, 2, pp_inter)
            out.bubble = ((c.pp - 1) * chunk * factor + hops) * c.grad_accum
            if shared_cores:
                # ... or the critical path (the busiest rank's work and the bubble) run at a whole core's
                # speed, if longer (the first and last ranks stand for the mean).
                critical = ((busiest[0] + busiest[1]) * runs + out.bubble) * d.cores_per_process
                out.bubble = max(0.0, critical - out.compute - out.exposed_comm)
            out.add("pp bubble", out.bubble)
        # Per step: AdamW over this rank's shard and gradient clipping (one all-reduce of the norm).
        local = self._local_params(c, view)
        optimizer = (self.elementwise(local * (28 + 4 + 4)) + self.host(3 * 40)) * d.compute_scale
        norm = collective_time(d, "all_reduce", 4, c.world_size, spans_nodes(d, 1, c.world_size))
        out.compute += optimizer
        out.add("compute: optimizer and clipping", optimizer)
        out.exposed_comm += norm
        out.comm_total += norm
        out.add("grad-norm all-reduce", norm)
        return out

    def _local_params(self, c: Candidate, view: RankView) -> float:
        shape = self.shape
        dense = sum(n * (b.params(c.tp, c.ep) - b.expert_params(c.ep)) for b, n in view.blocks)
        experts = sum(n * b.expert_params(c.ep) for b, n in view.blocks)
        dense += (shape.embedding_params / c.tp if view.first else 0) + (shape.output_params / c.tp if view.last else 0)
        if c.fsdp:
            return dense / (c.dp_shard * c.cp) + experts / max(1, c.dp_shard * c.cp // c.ep)
        return dense + experts


def _stages(c: Candidate) -> int:
    from titanctl.parallel.layouts.pipeline_stages import default_stages_per_rank

    return default_stages_per_rank(c.pp_schedule)


def mfu(tokens_per_second_per_device: float, flops_per_token: float, peak_tflops: float) -> float:
    return tokens_per_second_per_device * flops_per_token / (peak_tflops * 1e12) if peak_tflops else math.nan

"""What plan and estimate-memory count for the Gated DeltaNet layers (Qwen3.5): the chunked delta rule's FLOPs
against torch's FLOP counter on the kernel itself, the bytes a layer saves for backward against saved-tensor
hooks on the layer, the layer schedule's period in the estimator's depth shortcut, and the GPU recipes."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.conftest import REPO
from titanctl.config.recipe import load_config
from titanctl.models.common.args import LinearAttentionArgs
from titanctl.models.common.flops import active_params
from titanctl.models.common.gated_delta_rule import chunk_gated_delta_rule
from titanctl.models.common.gated_deltanet import GatedDeltaNet
from titanctl.models.qwen3_5.flops import CHUNK, gated_delta_rule_flops_per_token, hybrid_flops_per_token
from titanctl.models.qwen3_5_moe.args import QWEN3_5_MOE_FLAVORS
from titanctl.models.registry import spec_of
from titanctl.planning.memory.shortcuts import at_depth, block_period, depth_plan, schedule_period
from titanctl.planning.plan.memory_model import delta_rule_bytes_per_token
from titanctl.planning.plan.workload import model_shape

DEBUG = QWEN3_5_MOE_FLAVORS["debugmodel"].replace(vocab_size=512)


def rule_inputs(t: int, heads: int, dk: int, dv: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(1, t, heads, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, t, heads, dv, generator=gen)
    g, beta = -torch.rand(1, t, heads, generator=gen), torch.rand(1, t, heads, generator=gen)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta)]


def test_the_chunked_rules_flops_are_its_matmuls():
    """Forward, torch's counter (batched matmuls; it does not count triangular solves) gives exactly the
    formula less its solves; forward + backward, 92% of the formula's 3x (the solves' share, uncounted)."""
    t, heads, dk, dv = 256, 2, 32, 16
    args = DEBUG.replace(linear_attention=LinearAttentionArgs(num_key_heads=1, num_value_heads=heads, key_head_dim=dk,
                                                              value_head_dim=dv))
    inputs = rule_inputs(t, heads, dk, dv)
    with FlopCounterMode(display=False) as forward:
        out, _ = chunk_gated_delta_rule(*inputs)
    with FlopCounterMode(display=False) as backward:
        out.sum().backward()
    assert forward.get_total_flops() / t == heads * (CHUNK * (4 * dk + 2 * dv) + 6 * dk * dv)
    counted = (forward.get_total_flops() + backward.get_total_flops()) / t
    assert 0.85 < counted / gated_delta_rule_flops_per_token(args) < 1.0


def test_hybrid_flops_count_each_layer_by_its_kind():
    args = QWEN3_5_MOE_FLAVORS["35B-A3B"]
    seq = 4096
    full_layer = 12 * args.n_heads * args.head_dim * seq
    assert spec_of(args).flops_per_token(args, seq) == hybrid_flops_per_token(args, seq) == (
        6 * active_params(args) + 10 * full_layer + 30 * gated_delta_rule_flops_per_token(args))
    # The chunked rule costs 3 x 32 x (64 x 1024 + 6 x 128^2) = 15.7 MFLOPs per token and layer.
    assert gated_delta_rule_flops_per_token(args) == 3 * 32 * (64 * 1024 + 6 * 128 * 128)


@pytest.mark.parametrize("scan", [False, True], ids=["one_process", "cp_scan"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_saved_bytes_of_a_gated_deltanet_layer(dtype, scan):
    """The layer's saved tensors (its input and parameters aside), per token, against the plan's count: its
    linears' outputs as every block's are counted, plus ``delta_rule_bytes_per_token``; on a shape the
    formula was not fitted on (3 value heads per key head, d_v != d_k): within 2% (measured 0.4% bf16,
    1.4% fp32). ``cp_scan``: the layer under the CP scan (one rank's two chunks, its widened values), whose extra
    the plan counts under ring and ulysses_ring: within the same 2% (measured 0.8% bf16, 0.2% fp32, at 1024 tokens),
    where the plain count is 18% short."""
    from tests.unit.parallel.thread_ranks import FakeMesh
    from titanctl.parallel.layouts.linear_attention_cp import GatedDeltaNetScan

    la = LinearAttentionArgs(num_key_heads=2, num_value_heads=6, key_head_dim=32, value_head_dim=48)
    args = DEBUG.replace(dim=64, linear_attention=la)
    layer = GatedDeltaNet(args, 0).to(dtype)
    if scan:  # one CP rank (no peer): the widened rule, no collective
        layer.sequence_scan = GatedDeltaNetScan(FakeMesh(1, 0))
        layer.sequence_scan._gather = lambda pieces: pieces
    tokens = 1024 if scan else 256  # the scan's O(1) a sequence (chunk maps, states) 2.5% more at 256
    x = torch.randn(1, tokens, 64, dtype=dtype, requires_grad=True)
    skip = {p.untyped_storage().data_ptr() for p in (*layer.parameters(), x)}
    saved: dict[int, int] = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in skip:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        layer(x)
    act = dtype.itemsize
    # As activation_bytes_per_token counts linears: the column-wise ones' outputs, out_proj's input twice.
    linears = act * ((la.key_dim * 2 + la.value_dim) + la.value_dim + 2 * la.num_value_heads + 2 * la.value_dim)
    block = next(b for b in model_shape(args).blocks if b.delta_rule is not None)
    measured = sum(saved.values()) / tokens
    assert abs(measured - linears - delta_rule_bytes_per_token(block, 1, act, scan)) <= 0.02 * measured
    if scan:
        assert measured - linears - delta_rule_bytes_per_token(block, 1, act) > 0.1 * measured


def test_the_depth_shortcut_keeps_the_layer_schedule():
    """A hybrid model's blocks repeat every four layers: the estimator runs 4 and 5 groups of four (16 and
    20 of the 35B-A3B's 40 layers), each with the schedule of its own depth."""
    cfg = load_config(REPO / "recipes" / "qwen3_5_moe_35b_a3b.toml", [])
    args = QWEN3_5_MOE_FLAVORS["35B-A3B"]
    assert schedule_period(args.layer_types, args.n_layers) == 4
    assert schedule_period(("full_attention",), 40) == 1 and schedule_period((), 40) == 1
    assert block_period(cfg, args.layer_types, args.n_layers) == 4
    assert depth_plan(40, 4, all_layers=False) == [16, 20]
    assert at_depth(args, 16).layer_types == args.layer_types[:16]
    # A schedule that never repeats: its only period is the whole depth (no shortcut).
    assert schedule_period(("full_attention",) + ("linear_attention",) * 7, 8) == 8


@pytest.mark.parametrize("recipe, world_size", [("qwen3_5_moe_35b_a3b", 16), ("qwen3_5_moe_397b_a17b", 512),
                                              ("qwen3_next_80b_a3b", 32)])
def test_the_gpu_recipes_fit_by_the_fast_estimate(recipe, world_size):
    """The plan's fast path for each recipe's own layout: under an H100's 80 GB (74.5 GiB) with 8 GiB to
    spare for the CUDA context and workspaces. (estimate-memory's exact figures: docs/models.md.)"""
    from titanctl.planning.plan import devices
    from titanctl.planning.plan.candidates import Candidate
    from titanctl.planning.plan.search import Planner, recipe_config

    path = REPO / "recipes" / f"{recipe}.toml"
    cfg = recipe_config(path)
    p, t = cfg.parallelism, cfg.training
    pp = p.pipeline_parallel_degree
    dp = world_size // pp
    candidate = Candidate(1, dp, 1, pp, 1, p.expert_parallel_degree, t.local_batch_size, 1,
                          pp_schedule=p.pipeline_parallel_schedule if pp > 1 else "",
                          pp_microbatch_size=p.pipeline_parallel_microbatch_size,
                          ac="full" if cfg.activation_checkpoint.mode == "full" else "selective_op")
    planner = Planner(str(path), cfg, devices.resolve_device("h100", None, {}))
    assert 0 < planner.fast_memory(candidate) < (74.5 - 8) * 2**30


@pytest.mark.slow  # three estimates on fake tensors (about 8 s)
def test_a_hybrid_model_extrapolates_exactly():
    """Forty hybrid blocks from runs of sixteen and twenty (groups of the schedule's four) equal running all
    forty, byte for byte: the schedule of each shallow model is the full model's own."""
    from titanctl.planning.memory import estimate as memory

    overrides = ["--model.n_layers", "40", "--training.seq_len", "64", "--training.local_batch_size", "2",
                 "--activation_checkpoint.mode", "none"]
    fast = memory.estimate_memory(load_config(REPO / "recipes" / "qwen3_5_debug.toml", overrides), 1)
    full = memory.estimate_memory(load_config(REPO / "recipes" / "qwen3_5_debug.toml", overrides), 1, all_layers=True)
    assert fast.layers_run == [16, 20] and full.layers_run == [40]
    assert [(p.step, p.phase, p.peak, p.module) for p in fast.phases] == [
        (p.step, p.phase, p.peak, p.module) for p in full.phases]
    assert fast.categories == full.categories


def test_gated_deltanet_under_ulysses_is_costed_by_its_all_to_alls():
    """Under Ulysses a Gated DeltaNet block sends its conv inputs and b, a (conv_dim + 2 H_v per token) to key-head
    shards and the rule's output (value_dim) back, forward, and their gradients backward: (2 + r) all-to-alls of
    that width over cp (r: the forwards AC reruns; full AC, r = 1), no ring exchange and no scan; under the ring
    the prefix scan's gathers of each chunk's state map instead, and the attention blocks keep their own terms."""
    from titanctl.planning.plan import devices
    from titanctl.planning.plan.candidates import Candidate
    from titanctl.planning.plan.cost_model import collective_time
    from titanctl.planning.plan.search import Planner

    h100 = devices.resolve_device("h100", None, {})
    path = REPO / "recipes" / "qwen3_5_moe_35b_a3b.toml"
    planner = Planner(str(path), load_config(path, ["--training.seq_len", "262144"]), h100)
    args, la = planner.args, planner.args.linear_attention
    gdn = sum(args.is_linear_attention_layer(i) for i in range(args.n_layers))
    assert 0 < gdn < args.n_layers
    ulysses, ring = (planner.evaluate(Candidate(1, 4, 1, 1, 2, 8, 1, 1, ac="full", cp_method=m), 4).time.terms
                     for m in ("ulysses", "ring"))
    conv_dim = 2 * la.num_key_heads * la.key_head_dim + la.num_value_heads * la.value_head_dim
    width = conv_dim + 2 * la.num_value_heads + la.num_value_heads * la.value_head_dim
    one = collective_time(h100, "all_to_all", 262144 // 2 * width * 2, 2, False)  # bf16, one node
    assert ulysses["cp ulysses all-to-alls (gated deltanet)"] == pytest.approx(gdn * 3 * one, rel=1e-9)
    assert ulysses["cp ulysses all-to-alls"] > 0  # the full-attention blocks
    assert "cp gated deltanet scan" not in ulysses and "cp ring exchange" not in ulysses
    assert ring["cp gated deltanet scan"] > 0 and "cp ulysses all-to-alls (gated deltanet)" not in ring


def test_the_plan_enumerates_ulysses_for_the_hybrids_where_the_key_heads_split():
    """Qwen3.5's debug model has 8 heads but 2 key heads: Ulysses CP 2 is a candidate, CP 4 is refused by the
    trainer's Gated DeltaNet rule (its key heads after TP divide cp); ulysses_ring CP 4 = 2 x 2 (one key head per
    Ulysses rank) is one, CP 8 = 2 x 4 is refused by the same rule over the Ulysses degree."""
    from titanctl.models.registry import model_args_from_config
    from titanctl.planning.memory import estimate as memory
    from titanctl.planning.plan.candidates import enumerate_splits
    from titanctl.planning.plan.search import recipe_config

    cfg = recipe_config(REPO / "recipes" / "qwen3_5_debug.toml")
    args = model_args_from_config(cfg.model, memory.resolve_vocab_size(cfg)[0], cfg.training.seq_len)
    found = enumerate_splits(cfg, args, 8, 8, gpus_per_node=8, schedules=("1F1B",))
    methods = {(c.tp * c.cp, c.cp_method, c.cp_ulysses) for c in found.splits if c.cp > 1}
    assert (2, "ulysses", 1) in methods and (4, "ring", 1) in methods and (4, "ulysses", 1) not in methods
    assert (4, "ulysses_ring", 2) in methods and (8, "ulysses_ring", 4) not in methods
    assert found.rejected["ulysses context parallel splits the Gated DeltaNet layers by key heads"] > 0


def test_gated_deltanet_under_ulysses_ring_is_costed_by_both_exchanges():
    """Under ulysses_ring (qwen3_5_moe_35b_a3b, 256k tokens, CP 16 = 2 groups x Ulysses 8, full AC) a Gated
    DeltaNet block all-to-alls its conv inputs, b, a and output over the 8 Ulysses ranks (as Ulysses does over
    cp), then scans over the 2 groups for 1/8 of its heads: the state maps and halos of 2 x 2 chunks a sequence,
    over the network (the groups are 8 GPUs apart); no ring exchange."""
    from titanctl.planning.plan import devices
    from titanctl.planning.plan.candidates import Candidate
    from titanctl.planning.plan.cost_model import collective_time
    from titanctl.planning.plan.search import Planner

    h100 = devices.resolve_device("h100", None, {})
    path = REPO / "recipes" / "qwen3_5_moe_35b_a3b.toml"
    planner = Planner(str(path), load_config(path, ["--training.seq_len", "262144"]), h100)
    args, la = planner.args, planner.args.linear_attention
    gdn = sum(args.is_linear_attention_layer(i) for i in range(args.n_layers))
    hybrid = planner.evaluate(Candidate(1, 1, 1, 1, 16, 8, 1, 1, ac="full", cp_method="ulysses_ring", cp_ulysses=8),
                              16).time.terms
    conv_dim = 2 * la.num_key_heads * la.key_head_dim + la.num_value_heads * la.value_head_dim
    width = conv_dim + 2 * la.num_value_heads + la.num_value_heads * la.value_head_dim
    one = collective_time(h100, "all_to_all", 262144 // 16 * width * 2, 8, False)  # bf16, inside a node
    assert hybrid["cp ulysses all-to-alls (gated deltanet)"] == pytest.approx(gdn * 3 * one, rel=1e-9)
    states = 2 * 2 * la.num_value_heads / 8 * la.key_head_dim * (la.key_head_dim + la.value_head_dim) * 4
    halo = 2 * 2 * (la.conv_kernel - 1) * conv_dim / 8 * 2
    scan = sum(2 * collective_time(h100, "all_gather", n, 2, True) + collective_time(h100, "reduce_scatter", n, 2, True)
               for n in (states, halo))
    assert hybrid["cp gated deltanet scan"] == pytest.approx(gdn * scan, rel=1e-9)
    assert hybrid["cp masked ring sends"] > 0 and "cp ring exchange" not in hybrid  # the full-attention blocks


def test_the_scans_widened_values_are_costed_as_compute():
    """Under ring and ulysses_ring CP the scan runs each Gated DeltaNet block's chunked rule over d_v + d_k value
    columns: the FLOPs that adds (3 H_v (3 C d_k + 6 d_k^2) per token: the formula's widened count less its own) at
    attention's efficiency, forward, its recompute under full AC and backward, over this rank's tokens. Ulysses
    runs the plain rule: no such term."""
    from titanctl.planning.plan import devices
    from titanctl.planning.plan.candidates import Candidate
    from titanctl.planning.plan.search import Planner

    h100 = devices.resolve_device("h100", None, {})
    path = REPO / "recipes" / "qwen3_5_moe_35b_a3b.toml"
    planner = Planner(str(path), load_config(path, ["--training.seq_len", "262144"]), h100)
    args, la = planner.args, planner.args.linear_attention
    gdn = sum(args.is_linear_attention_layer(i) for i in range(args.n_layers))
    extra = 3 * la.num_value_heads * (3 * CHUNK * la.key_head_dim + 6 * la.key_head_dim ** 2)
    assert planner.cost.s.scan_widening_flops_per_token == extra
    seconds = 4 / 3 * extra * 262144 / 4 / (h100.peak_tflops("bfloat16") * 1e12 * h100.attention_efficiency)
    for method, u in (("ring", 1), ("ulysses_ring", 2)):
        terms = planner.evaluate(Candidate(1, 1, 1, 1, 4, 4, 1, 1, ac="full", cp_method=method, cp_ulysses=u),
                                 4).time.terms
        widened = terms["compute: gated deltanet scan (widened values)"]
        assert widened == pytest.approx(gdn * seconds * h100.compute_scale, rel=1e-9), method
    ulysses = planner.evaluate(Candidate(1, 1, 1, 1, 4, 4, 1, 1, ac="full", cp_method="ulysses"), 4).time.terms
    assert "compute: gated deltanet scan (widened values)" not in ulysses


@pytest.mark.slow  # two estimates on fake tensors (about 4 s)
def test_the_fast_path_under_ulysses_is_as_near_as_in_one_process():
    """Qwen3.5 debug under Ulysses CP 2: the fast path's ratio to estimate-memory's exact peak is the one-process
    layout's (the Gated DeltaNet and attention layers keep H / cp heads of the whole sequence, as many bytes as
    every head of 1 / cp of it). The debug model's own ratio, about 0.88 on both, is outside the larger recipes'
    6% (fixed small buffers the fast path does not count weigh more in a 0.06 GiB model)."""
    from titanctl.planning.plan import devices
    from titanctl.planning.plan.candidates import Candidate
    from titanctl.planning.plan.search import Planner, recipe_config

    path = REPO / "recipes" / "qwen3_5_debug.toml"
    planner = Planner(str(path), recipe_config(path), devices.resolve_device("h100", None, {}))
    ratios = []
    for c in (Candidate(1, 4, 1, 1, 1, 1, 1, 1, ac="none"),
              Candidate(1, 2, 1, 1, 2, 1, 2, 1, ac="none", cp_method="ulysses")):
        exact, _ = planner.exact_memory(c, 4)
        ratios.append(planner.fast_memory(c) / exact)
    assert ratios[1] == pytest.approx(ratios[0], abs=0.01), ratios
    assert 0.8 < ratios[1] < 1.06, ratios

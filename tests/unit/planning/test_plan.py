"""`titanctl plan` in one process: devices, enumeration checked by the trainer's own rules, the memory
and time models, and the exact estimates of the finalists."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch.distributed as dist

from tests.conftest import REPO
from titanctl.config.recipe import load_config
from titanctl.errors import ConfigError, ParallelError
from titanctl.models.registry import model_args_from_config
from titanctl.parallel.layouts.build import check_layout
from titanctl.parallel.layouts.dims import ParallelDims
from titanctl.parallel.layouts.pipeline_parallel import microbatch_count
from titanctl.parallel.layouts.pipeline_stages import pipeline_layer_ranges
from titanctl.planning.memory import estimate as memory
from titanctl.planning.plan import calibrate, devices
from titanctl.planning.plan.candidates import Candidate, variants
from titanctl.planning.plan.cost_model import collective_time, spans_nodes
from titanctl.planning.plan.search import plan, recipe_config

DEBUG = REPO / "recipes" / "llama3_debug.toml"
H100 = devices.resolve_device("h100", None, {})


@pytest.fixture(autouse=True)
def no_process_group():
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized()


def trainer_accepts(recipe, overrides: list[str], world_size: int) -> None:
    """What train checks before its first collective, from the printed command line's overrides."""
    cfg = load_config(recipe, overrides, command="train")
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    vocab, _ = memory.resolve_vocab_size(cfg)
    args = model_args_from_config(cfg.model, vocab, cfg.training.seq_len)
    check_layout(cfg, dims, args)
    memory.grad_accum_steps(cfg, dims.dp)
    if dims.pp > 1:
        p = cfg.parallelism
        ranges = pipeline_layer_ranges(args.n_layers, dims.pp, p.pipeline_parallel_schedule,
                                       split_points=p.pipeline_parallel_split_points,
                                       layers_per_stage=p.pipeline_parallel_layers_per_stage)
        microbatch_count(cfg.training.local_batch_size, p.pipeline_parallel_microbatch_size,
                         p.pipeline_parallel_schedule, len(ranges), dims.pp)


# ------------------------------------------------------------------------------- devices


def test_presets_carry_the_datasheet_figures():
    assert (H100.peak_bf16_tflops, H100.peak_fp8_tflops, H100.gpus_per_node) == (989.0, 1979.0, 8)
    assert H100.intra_node_gbps == 450.0 and H100.inter_node_gbps == 50.0 and H100.async_tp
    a100 = devices.resolve_device("a100", None, {})
    assert a100.peak_bf16_tflops == 312.0 and a100.peak_fp8_tflops == 0 and not a100.async_tp
    assert devices.resolve_device("mi300x", None, {}).memory_gib == pytest.approx(192e9 / 2**30)


def test_command_line_figures_override_the_preset():
    d = devices.resolve_device("h100", None, {"memory_gib": 40.0, "gpus_per_node": 4, "inter_node_gbps": None})
    assert d.memory_gib == 40.0 and d.gpus_per_node == 4 and d.inter_node_gbps == 50.0


@pytest.mark.parametrize("name, needle", [("cpu", "--calibrate"), ("tpu", "unknown --device 'tpu'")])
def test_a_device_without_figures_is_refused(name, needle):
    with pytest.raises(ConfigError, match=needle):
        devices.resolve_device(name, None, {})


def test_a_cluster_file_round_trips(tmp_path):
    measured = dataclasses.replace(
        H100, name="cpu", target="cpu", source="test", collectives={"all_gather": devices.Link(1.5, 20.0)})
    path = tmp_path / "cluster.toml"
    path.write_text(devices.cluster_toml(measured, ["a comment"]))
    assert devices.resolve_device(None, path, {}) == measured
    assert devices.resolve_device("cpu", path, {"memory_gib": 8.0}).memory_gib == 8.0


def test_a_bad_cluster_file_is_one_error(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text("[device]\nname = 'cpu'\nmatmul_efficiency = 1.5\n")
    with pytest.raises(ConfigError, match="matmul_efficiency = 1.5 in .* must be a fraction"):
        devices.resolve_device(None, path, {})
    path.write_text("[device]\nname = 'h100'\nwarp_speed = 9\n")
    with pytest.raises(ConfigError, match="unknown key 'warp_speed'"):
        devices.resolve_device(None, path, {})


# ------------------------------------------------------------------------------- fits of the calibration


def test_link_fit_recovers_latency_and_bandwidth():
    world, latency, gbps = 4, 50e-6, 2.0
    for kind in ("all_gather", "all_reduce", "p2p"):
        d = dataclasses.replace(H100, collectives={kind: devices.Link(gbps, latency * 1e6)})
        samples = [(n, collective_time(d, kind, n, 2 if kind == "p2p" else world, False)) for n in (4096, 1 << 20, 8 << 20)]
        link = calibrate.fit_link(kind, samples, world)
        assert link.gbps == pytest.approx(gbps, rel=1e-6) and link.latency_us == pytest.approx(50.0, rel=1e-6)


def test_matmul_fit_recovers_efficiency_and_half_dim():
    peak, efficiency, half = 1e11, 0.5, 2 ** (20 / 4)
    samples = [((m, n, k), 2 * m * n * k / (peak * efficiency * (m / (m + half)) * (n / (n + half)) * (k / (k + half))))
               for m, n, k in calibrate._MATMUL_SHAPES]
    fitted_efficiency, fitted_half = calibrate.fit_matmul(samples, peak)
    assert fitted_efficiency == pytest.approx(efficiency, rel=1e-6) and fitted_half == pytest.approx(half)


# ------------------------------------------------------------------------------- the time model's terms


def test_collectives_follow_the_ring_formulas():
    link = H100.link("all_gather", False)
    n, size = 8, 1 << 30
    expected = (n - 1) * link.latency_us * 1e-6 + (n - 1) / n * size / (link.gbps * 1e9)
    assert collective_time(H100, "all_gather", size, n, False) == pytest.approx(expected)
    assert collective_time(H100, "all_reduce", size, n, False) == pytest.approx(2 * expected)
    assert collective_time(H100, "all_gather", size, n, True) > 5 * collective_time(H100, "all_gather", size, n, False)
    assert collective_time(H100, "all_gather", size, 1, False) == 0
    assert not spans_nodes(H100, 1, 8) and spans_nodes(H100, 8, 2) and not spans_nodes(H100, 2, 4)


def test_more_pipeline_microbatches_shrink_the_bubble():
    cfg = recipe_config(REPO / "recipes" / "llama3_8b.toml")
    from titanctl.planning.plan.search import Planner

    planner = Planner("llama3_8b", cfg, H100)
    bubbles = []
    for mb_size in (4, 2, 1):
        c = Candidate(1, 2, 1, 4, 1, 1, 16, 1, pp_schedule="1F1B", pp_microbatch_size=mb_size, ac="full")
        bubbles.append(planner.evaluate(c, 32).time.bubble / planner.evaluate(c, 32).time.step)
    assert bubbles[0] > bubbles[1] > bubbles[2] > 0
    interleaved = dataclasses.replace(c, pp_schedule="Interleaved1F1B")
    assert planner.evaluate(interleaved, 32).time.bubble < planner.evaluate(c, 32).time.bubble


def test_a_pipeline_on_shared_cores_costs_the_ranks_mean_work():
    """Processes that share cores (cores_per_process < 1): the ranks' mean work is what a step costs, not
    the busiest rank's (the last stage's output layer and loss spread over the cores while others wait)."""
    cfg = recipe_config(DEBUG)
    from titanctl.planning.plan.search import Planner

    c = Candidate(1, 2, 1, 2, 1, 1, 16, 1, pp_schedule="1F1B", pp_microbatch_size=4, ac="none")
    own_cores = dataclasses.replace(H100, host_runs_ahead=False)
    shared = dataclasses.replace(own_cores, cores_per_process=0.5)
    busiest = Planner("llama3_debug", cfg, own_cores).evaluate(c, 32).time
    mean = Planner("llama3_debug", cfg, shared).evaluate(c, 32).time
    assert mean.compute < 0.95 * busiest.compute
    assert mean.step >= 0.5 * (busiest.compute + busiest.exposed_comm)  # the critical path at a whole core


def test_context_parallel_is_costed_by_its_method():
    """Ulysses: all-to-alls of q, k, v and the output (O(S / cp) per rank) and no DTensor ring; the ring: its
    K/V exchange (O(S)). The plan proposes both, and Ulysses only where the heads split over tp x cp."""
    from titanctl.planning.plan.candidates import enumerate_splits
    from titanctl.planning.plan.search import Planner

    cfg = recipe_config(REPO / "recipes" / "llama3_8b.toml")  # 32 heads, 8 KV heads
    planner = Planner("llama3_8b", cfg, H100)
    ring = Candidate(1, 1, 1, 1, 8, 1, 1, 1, ac="full")
    terms = {m: planner.evaluate(dataclasses.replace(ring, cp_method=m), 8).time.terms for m in ("ring", "ulysses")}
    assert terms["ring"]["cp ring exchange"] > terms["ulysses"]["cp ulysses all-to-alls"] > 0
    assert "cp ring exchange" not in terms["ulysses"] and "cp ulysses all-to-alls" not in terms["ring"]
    ulysses = dataclasses.replace(ring, cp_method="ulysses")
    assert " ".join(ulysses.overrides(8)).count("--parallelism.context_parallel_method ulysses") == 1
    assert ulysses.describe() == "cp 8 ulysses"
    debug = recipe_config(DEBUG)  # 8 heads: Ulysses up to tp x cp = 8
    args = model_args_from_config(debug.model, memory.resolve_vocab_size(debug)[0], debug.training.seq_len)
    found = enumerate_splits(debug, args, 32, 32, gpus_per_node=8, schedules=("1F1B",))
    methods = {(c.tp * c.cp, c.cp_method) for c in found.splits if c.cp > 1}
    assert (8, "ulysses") in methods and (16, "ring") in methods and (16, "ulysses") not in methods
    assert found.rejected["ulysses context parallel splits the heads"] > 0, found.rejected


def test_the_plan_takes_the_cp_method_that_moves_fewer_bytes():
    """Per block and rank, over the same link: the ring moves 3 (cp - 1) / cp x S x kv bytes (K/V forward, again
    and their gradients backward; the masked ring 3 + r shifts, r the share of forwards AC recomputes), Ulysses
    (2 + r) (cp - 1) / cp^2 x S x (2 q + kv) (q, k, v and the output). So where the heads allow Ulysses it wins
    once cp > (2 + r)(2 q + kv) / (3 kv), masked (3 + r); Llama 3.1 8B (q 4096, kv 2048), full AC (r = 1): from
    cp 5 under a causal mask, from cp 4 under documents. Otherwise the ring is the faster."""
    from titanctl.planning.plan.search import Planner

    path = REPO / "recipes" / "llama3_8b.toml"
    q, kv, r = 4096, 2048, 1.0
    for mask, shifts in (("causal", 3), ("block_causal", 3 + r)):
        planner = Planner(str(path), load_config(path, ["--training.seq_len", "131072", "--model.attn_mask_type",
                                                        mask]), H100)
        exchange = "cp ring exchange" if mask == "causal" else "cp masked ring sends"
        for cp in (2, 4, 8):
            times = {m: planner.evaluate(Candidate(1, 8 // cp, 1, 1, cp, 1, 1, 1, ac="full", cp_method=m), 8 // cp)
                     for m in ("ring", "ulysses")}
            faster = min(times, key=lambda m: times[m].time.step)
            assert faster == ("ulysses" if cp > (2 + r) * (2 * q + kv) / (shifts * kv) else "ring"), (mask, cp)
            assert exchange in times["ring"].time.terms


def _cp_times(seq_len: int, cp: int, dp_shard: int) -> dict[tuple[str, int], object]:
    """Llama 3.1 8B at ``seq_len`` on cp x dp_shard H100s (8 a node), full AC: the step time of each CP method the
    plan enumerates at that degree (method, Ulysses degree)."""
    from titanctl.planning.plan.candidates import cp_methods
    from titanctl.planning.plan.search import Planner

    path = REPO / "recipes" / "llama3_8b.toml"
    planner = Planner(str(path), load_config(path, ["--training.seq_len", str(seq_len)]), H100)
    return {(m, u): planner.evaluate(Candidate(1, dp_shard, 1, 1, cp, 1, 1, 1, ac="full", cp_method=m,
                                               cp_ulysses=u), dp_shard).time
            for m, u in cp_methods(cp, 1, H100.gpus_per_node)}


def test_the_plan_takes_ulysses_ring_where_cp_leaves_the_node():
    """CP 16 over two nodes of 8, Llama 3.1 8B (q 4096, kv 2048 per token) at 256k, full AC (r = 1), per block and
    rank in units of S / 16 tokens: plain Ulysses sends (2 + r) 15/16 (2 q + kv) = 28,800 over the network (its
    16 ranks span the nodes), the ring 3 x 15 kv = 92,160; the hybrid with u = 8 sends (2 + r) 7/8 (2 q + kv)
    inside the node (9x faster) and (3 + r) x 1 kv = 8,192 over the network in its ring of 2 groups: the fewest
    bytes at the slow link, so it is the fastest, and the printed command line sets both keys."""
    times = _cp_times(262144, 16, 1)
    assert set(times) == {("ring", 1), ("ulysses", 1), ("ulysses_ring", 2), ("ulysses_ring", 4),
                          ("ulysses_ring", 8)}  # u = 16 is plain Ulysses: not a hybrid
    assert min(times, key=lambda k: times[k].step) == ("ulysses_ring", 8)
    hybrid = times["ulysses_ring", 8].terms
    assert hybrid["cp ulysses all-to-alls"] < times["ulysses", 1].terms["cp ulysses all-to-alls"] / 5
    assert 0 < hybrid["cp masked ring sends"] < times["ring", 1].terms["cp ring exchange"] / 5
    c = Candidate(1, 1, 1, 1, 16, 1, 1, 1, ac="full", cp_method="ulysses_ring", cp_ulysses=8)
    assert c.describe() == "cp 16 ulysses_ring (ulysses 8)"
    args = " ".join(c.overrides(1))
    assert "--parallelism.context_parallel_method ulysses_ring" in args
    assert "--parallelism.context_parallel_ulysses_degree 8" in args
    trainer_accepts(REPO / "recipes" / "llama3_8b.toml", c.overrides(1), 16)
    # A recipe's own hybrid settings do not leak into the plan's other methods (their degree is reset to 1).
    hybrid_recipe = ["--parallelism.context_parallel_method", "ulysses_ring",
                     "--parallelism.context_parallel_ulysses_degree", "4"]
    for m in ("ring", "ulysses"):
        trainer_accepts(REPO / "recipes" / "llama3_8b.toml",
                        hybrid_recipe + dataclasses.replace(c, cp_method=m, cp_ulysses=1).overrides(1), 16)
    assert c.to_json()["cp_ulysses_degree"] == 8
    assert not any(v.compile for v in variants(c, compile_options=(False, True), float8=False, async_tp=False))


def test_the_plan_keeps_plain_ulysses_inside_one_node():
    """CP 8 on one node: every link is the node's, so the hybrid only adds its ring's (3 + r)(8 / u - 1) shifts of
    the K/V shard to all-to-alls over fewer ranks (u = 4: (2 + r) 3/4 (2 q + kv) + 4 kv = 31,232 bytes per S / 8
    tokens against Ulysses' (2 + r) 7/8 (2 q + kv) = 26,880): plain Ulysses is the fastest. And no Ulysses degree
    that leaves the node (tp x u not dividing the GPUs per node) is enumerated."""
    from titanctl.planning.plan.candidates import cp_methods

    times = _cp_times(262144, 8, 2)
    assert min(times, key=lambda k: times[k].step) == ("ulysses", 1)
    assert times["ulysses_ring", 4].terms["cp masked ring sends"] > 0
    assert ("ulysses_ring", 4) not in cp_methods(8, 4, 8) and ("ulysses_ring", 2) in cp_methods(8, 4, 8)
    assert cp_methods(1, 1, 8) == [("ring", 1)]


# ------------------------------------------------------------------------------- the plan


@pytest.fixture(scope="module")
def debug_plan():
    cfg = recipe_config(DEBUG)
    return plan(str(DEBUG), cfg, 4, H100, top=12, exact=2, compile_options=(False,))


@pytest.mark.slow  # the plan's exact estimates run in a forked child
def test_every_printed_layout_passes_the_trainers_validation(debug_plan):
    assert len(debug_plan.layouts) == 12
    kinds = set()
    for layout in debug_plan.layouts:
        c = layout.candidate
        assert c.world_size == 4 and c.dp * c.local_batch_size * c.grad_accum == debug_plan.global_batch
        trainer_accepts(DEBUG, c.overrides(debug_plan.global_batch), 4)
        kinds.add((c.dp_replicate > 1, c.dp_shard > 1, c.tp > 1, c.pp > 1, c.cp > 1))
    assert len(kinds) > 1
    steps = [layout.time.step for layout in debug_plan.layouts]
    assert steps == sorted(steps)


@pytest.mark.slow  # the plan's exact estimates run in a forked child
def test_the_finalists_memory_is_estimate_memorys(debug_plan):
    exact = [layout for layout in debug_plan.layouts if layout.exact_memory is not None]
    assert len(exact) == 2
    first = exact[0]
    cfg = load_config(DEBUG, first.candidate.overrides(debug_plan.global_batch), command="train")
    estimate = memory.estimate_memory(cfg, 4, device="cuda")
    assert first.exact_memory == estimate.peak
    # The fast path is an approximation of the same peak.
    assert 0.5 < first.fast_memory / first.exact_memory < 2


@pytest.mark.slow  # each exact estimate runs a step on fake tensors (1-2 s)
@pytest.mark.parametrize("recipe, global_batch, candidate", [
    ("llama3_8b", 8, Candidate(1, 8, 1, 1, 1, 1, 1, 1, ac="full")),
    ("llama3_8b", 16, Candidate(1, 8, 1, 1, 1, 1, 1, 2, ac="full")),
    ("llama3_8b", 16, Candidate(1, 8, 1, 1, 1, 1, 2, 1, ac="selective_op")),
    ("llama3_8b", 8, Candidate(1, 8, 1, 1, 1, 1, 1, 1, ac="selective_2")),
    ("llama3_8b", 8, Candidate(1, 8, 1, 1, 1, 1, 1, 1, ac="none")),
    ("llama3_8b", 8, Candidate(1, 4, 2, 1, 1, 1, 2, 1, ac="selective_op")),
    ("llama3_8b", 8, Candidate(1, 4, 1, 1, 2, 1, 2, 1, ac="none")),
    # Ulysses: attention keeps head shards of the whole sequence (H / cp heads x S) where the ring keeps sequence
    # shards of every head, as many bytes: the exact estimates agree to 0.01%, the fast path models both alike.
    ("llama3_8b", 8, Candidate(1, 4, 1, 1, 2, 1, 2, 1, ac="none", cp_method="ulysses")),
    ("llama3_8b", 8, Candidate(2, 4, 1, 1, 1, 1, 1, 1, ac="full")),
    ("qwen3_moe_30b_a3b", 8, Candidate(1, 8, 1, 1, 1, 8, 1, 1, ac="full")),
    # Attention sinks (the softmax written out, a chunk of queries at a time) and biased experts.
    ("gpt_oss_20b", 8, Candidate(1, 8, 1, 1, 1, 1, 1, 1, ac="full")),
    # A frozen base: fp32 parameters without gradients or Adam's state; the adapters' are small.
    ("llama3_8b_lora", 8, Candidate(1, 8, 1, 1, 1, 1, 1, 1, ac="full")),
    ("llama3_8b_lora", 16, Candidate(1, 4, 2, 1, 1, 1, 2, 1, ac="selective_op")),
], ids=lambda v: v.describe() + " " + v.ac if isinstance(v, Candidate) else str(v))
def test_the_fast_path_is_near_the_exact_estimate(recipe, global_batch, candidate):
    from titanctl.planning.plan.search import Planner

    path = REPO / "recipes" / f"{recipe}.toml"
    planner = Planner(str(path), recipe_config(path), H100)
    exact, _ = planner.exact_memory(candidate, global_batch)
    assert planner.fast_memory(candidate) / exact == pytest.approx(1, abs=0.06)


@pytest.mark.slow  # one exact estimate (a few seconds)
def test_a_pipelines_memory_is_its_busiest_ranks():
    # estimate-memory runs rank 0; the last stage's logits make a later rank hold more, which the plan shows.
    from titanctl.planning.plan.search import Layout, Planner

    path = REPO / "recipes" / "llama3_8b.toml"
    planner = Planner(str(path), recipe_config(path), H100)
    flat = Candidate(1, 8, 1, 1, 1, 1, 1, 1, ac="full")
    assert planner.fast_memory(flat, after_rank0=True) == 0
    piped = Candidate(1, 2, 1, 4, 1, 1, 8, 1, pp_schedule="1F1B", ac="full")
    exact, _ = planner.exact_memory(piped, 16)
    later = planner.fast_memory(piped, after_rank0=True)
    assert later > exact
    layout = Layout(piped, planner.fast_memory(piped), None, 0.0, 0.0, exact, later_ranks_memory=later)
    assert layout.memory == later and not layout.memory_is_exact
    assert Layout(flat, 1.0, None, 0.0, 0.0, 2.0).memory_is_exact


@pytest.mark.slow  # the plan's exact estimates run in a forked child
def test_the_json_rows_have_the_issues_fields(debug_plan):
    rows = debug_plan.to_json()
    for row in rows:
        for key in ("dp_shard", "dp_replicate", "tp", "pp", "cp", "ep", "pp_schedule", "microbatches", "ac",
                    "memory_gib", "step_s", "tokens_per_second_per_device", "mfu", "memory_exact", "torchrun"):
            assert key in row, key
        assert row["tokens_per_second_per_device"] == pytest.approx(
            debug_plan.global_batch * debug_plan.seq_len / row["step_s"] / 4)
        assert 0 < row["mfu"] < 1 and math.isfinite(row["step_s"])
    # The first two got the exact estimate (rank 0); a pipeline's later rank can hold more (fast estimate).
    assert all(layout.exact_memory is not None for layout in debug_plan.layouts[:2])
    for row, layout in zip(rows, debug_plan.layouts):
        assert row["memory_exact"] == layout.memory_is_exact
        assert row["memory_gib"] == round(layout.memory / 2**30, 3)
        if layout.exact_memory is not None and not layout.memory_is_exact:
            assert row["pp"] > 1 and layout.memory == layout.later_ranks_memory > layout.exact_memory


@pytest.mark.slow  # the plan's exact estimates run in a forked child
def test_every_layout_that_fits_is_timed_and_refusals_are_counted(debug_plan):
    r = debug_plan.rejected
    assert any("DDP" in reason for reason in r), r  # DDP x TP, DDP x PP: the trainer's refusals
    assert debug_plan.considered > 100


def test_tensor_parallel_stays_within_a_node():
    cfg = recipe_config(DEBUG)
    four = dataclasses.replace(H100, gpus_per_node=2)
    result = plan(str(DEBUG), cfg, 4, four, top=50, exact=0, compile_options=(False,), ac_modes=("none",))
    assert all(layout.candidate.tp <= 2 for layout in result.layouts)
    assert result.rejected["tp must stay within a node"] >= 1


def test_a_gpu_count_the_model_cannot_use_is_one_error():
    cfg = recipe_config(DEBUG)  # 6 layers, 16 heads of which 4 key/value, seq 256
    with pytest.raises(ParallelError, match="no layout of llama3 debugmodel uses 7 devices"):
        plan(str(DEBUG), cfg, 7, H100, global_batch=8, exact=0)


def test_a_model_that_fits_nowhere_is_one_error():
    cfg = recipe_config(REPO / "recipes" / "llama3_405b.toml")
    with pytest.raises(ParallelError, match="no layout of llama3 405B on 8 x h100 fits"):
        plan("llama3_405b", cfg, 8, H100, exact=0)


@pytest.mark.parametrize("gpus, global_batch, needle", [
    (10**12, None, "--gpus 1,000,000,000,000 is more devices than any cluster holds: the plan takes at most 1,048,576"),
    (2**64, None, "--gpus 18,446,744,073,709,551,616 is more devices than any cluster holds"),
    (8, 10**15, "a global batch of 1,000,000,000,000,000 sequences of 256 tokens .--global-batch. is 256,000,000,000,"
                "000,000 tokens per step, beyond any real run's .* at most 1,073,741,824"),
], ids=["gpus-10^12", "gpus-2^64", "global-batch-10^15"])
def test_absurd_device_counts_and_batches_are_refused_before_enumerating(monkeypatch, gpus, global_batch, needle):
    """Issue 46/47: these ran for hours (a loop to N per divisor list); refused before any layout is built."""
    from titanctl.planning.plan import search

    def enumerated(*args, **kwargs):
        raise AssertionError("enumerated layouts for an absurd input")

    monkeypatch.setattr(search, "enumerate_splits", enumerated)
    with pytest.raises(ParallelError, match=needle):
        plan(str(DEBUG), recipe_config(DEBUG), gpus, H100, global_batch=global_batch, exact=0)


def test_divisors_are_found_up_to_the_square_root():
    from titanctl.planning.plan.candidates import divisors

    for n in (1, 2, 12, 36, 97, 720720):
        assert divisors(n) == tuple(d for d in range(1, n + 1) if n % d == 0)
    assert len(divisors(2**30)) == 31 and divisors(2**31 - 1) == (1, 2**31 - 1)  # a prime: 46k steps, not 2^31


def test_timed_layouts_are_kept_to_the_fastest_that_can_be_shown(monkeypatch):
    """Millions of layouts (DeepSeek-V3 671B on 65,536 GPUs: 10.9M, ~16 GB as a list) are timed in bounded
    memory: the list is cut to the fastest top + exact, and what is shown is what sorting them all shows."""
    import weakref

    from titanctl.planning.plan import search

    cfg = recipe_config(DEBUG)
    options = dict(top=3, exact=0, compile_options=(False, True))
    everything = plan(str(DEBUG), cfg, 8, H100, **options)
    live, peak = [0], [0]
    real = search.Planner.evaluate

    def counted(self, *args, **kwargs):
        layout = real(self, *args, **kwargs)
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        weakref.finalize(layout, lambda: live.__setitem__(0, live[0] - 1))
        return layout

    monkeypatch.setattr(search.Planner, "evaluate", counted)
    monkeypatch.setattr(search, "CUT_AFTER", 0)
    cut = plan(str(DEBUG), cfg, 8, H100, **options)
    assert cut.considered == everything.considered > 1000
    assert peak[0] <= 2 * 3 + 16 + 1, peak[0]  # 2 x (top + exact), and one set of degrees' variants beyond
    assert [(layout.candidate, layout.time.step) for layout in cut.layouts] == \
        [(layout.candidate, layout.time.step) for layout in everything.layouts]


def test_a_calibration_this_host_cannot_run_is_refused_before_measuring(monkeypatch, tmp_path):
    """Issue 47: 64 processes on 2 cores started 64 torch processes (past 2 GiB); a missing --cluster folder
    failed after 30 s of measuring. Both are refused before a process starts."""
    import torch.multiprocessing

    def measured(*args, **kwargs):
        raise AssertionError("started measuring")

    monkeypatch.setattr(torch.multiprocessing, "start_processes", measured)
    monkeypatch.setattr(calibrate.os, "cpu_count", lambda: 2)
    with pytest.raises(ConfigError, match="--gpus 64: the calibration runs that many processes at once on this "
                                          r"host's 2 core\(s\); at most 8 \(4 per core\)"):
        calibrate.calibrate(64, tmp_path / "c.toml", log=None)
    monkeypatch.setattr(calibrate, "available_bytes", lambda: 2**30)
    with pytest.raises(ConfigError, match=r"--gpus 2: 2 measuring processes need about 1.2 GiB .* 1.0 GiB available"):
        calibrate.calibrate(2, tmp_path / "c.toml", log=None)
    monkeypatch.setattr(calibrate, "available_bytes", lambda: 2**40)
    with pytest.raises(ConfigError, match=r"folder .*missing.dir does not exist"):
        calibrate.calibrate(2, tmp_path / "missing" / "dir" / "c.toml", log=None)
    with pytest.raises(ConfigError, match="is a folder"):
        calibrate.calibrate(2, tmp_path, log=None)


def test_no_exact_estimate_starts_past_the_time_budget():
    cfg = recipe_config(DEBUG)
    result = plan(str(DEBUG), cfg, 4, H100, top=2, exact=3, budget_seconds=0, compile_options=(False,))
    assert all(layout.exact_memory is None for layout in result.layouts)
    assert any("time budget" in note for note in result.notes)


def test_the_recipes_activation_checkpointing_can_be_kept():
    from titanctl.planning.plan.search import ac_modes_from

    assert ac_modes_from("recipe", recipe_config(REPO / "recipes" / "llama3_8b.toml")) == ("selective_op",)
    assert ac_modes_from("recipe", recipe_config(REPO / "recipes" / "llama3_70b.toml")) == ("full",)
    assert ac_modes_from("none,full", recipe_config(DEBUG)) == ("none", "full")
    with pytest.raises(ConfigError, match="--ac 'some'"):
        ac_modes_from("some", recipe_config(DEBUG))


def test_compute_scale_multiplies_the_compute_terms_only():
    cfg = recipe_config(DEBUG)
    from titanctl.planning.plan.search import Planner

    c = Candidate(1, 4, 1, 1, 1, 1, 8, 1, ac="none")
    one = Planner("llama3_debug", cfg, H100).evaluate(c, 32).time
    two = Planner("llama3_debug", cfg, dataclasses.replace(H100, compute_scale=2.0)).evaluate(c, 32).time
    assert two.compute == pytest.approx(2 * one.compute)
    assert two.comm_total == pytest.approx(one.comm_total)


def test_the_workload_counts_gpt_oss_expert_biases_as_expert_parameters():
    from titanctl.models.gpt_oss.args import GPT_OSS_FLAVORS
    from titanctl.models.shapes import num_params
    from titanctl.planning.plan.workload import model_shape

    args = GPT_OSS_FLAVORS["20b"]
    shape = model_shape(args)
    block = shape.blocks[0]
    # w13 (2F x D), w2 (D x F) and the biases b13 (2F), b2 (D) of each expert; none of them a dense linear.
    assert block.experts.params_per_expert == 3 * 2880 * 2880 + 2 * 2880 + 2880
    assert not any(".experts." in lin.name for lin in block.linears)
    total = sum(b.params(1, 1) for b in shape.blocks) + shape.embedding_params + shape.output_params
    assert total + shape.final_norm_params == num_params(args)
    assert block.params(1, 4) == block.params(1, 1) - 3 * block.expert_params(4)  # biases split with their experts



def test_muons_single_momentum_buffer_is_counted_by_the_fast_path():
    from titanctl.planning.plan.search import Planner

    path = REPO / "recipes" / "llama3_8b.toml"
    muon_cfg = recipe_config(path)
    muon_cfg.optimizer.name = "Muon"
    adamw, muon = Planner(str(path), recipe_config(path), H100), Planner(str(path), muon_cfg, H100)
    candidate = Candidate(1, 8, 1, 1, 1, 1, 1, 1, ac="full")
    # Llama 3.1 8B's 32 blocks' matrices (wq, wo 4096^2; wk, wv 1024 x 4096; w1, w2, w3 14336 x 4096), sharded
    # over 8 ranks, keep one fp32 momentum buffer instead of Adam's two moments; embeddings and output stay AdamW.
    matrices = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)
    saved = adamw.fast_memory(candidate) - muon.fast_memory(candidate)
    assert saved == pytest.approx(4 * matrices / 8, rel=1e-3)  # the blocks' norms are not matrices


def test_plan_proposes_context_parallel_for_long_sequences():
    """Llama 3 8B on 8 H100s: at 2k tokens a data-parallel layout is fastest; at 128k no layout without CP fits
    (one sequence's activations) or wins, so every proposal shards the sequence."""
    recipe = REPO / "recipes" / "llama3_8b.toml"
    best = {}
    for seq_len, global_batch in ((2048, 32), (131072, 8)):
        cfg = load_config(recipe, ["--training.seq_len", str(seq_len)])
        found = plan(str(recipe), cfg, 8, H100, top=3, exact=0, global_batch=global_batch,
                     compile_options=(False,), float8=False, schedules=("1F1B",), ac_modes=("full",))
        best[seq_len] = [layout.candidate for layout in found.layouts]
    assert best[2048][0].cp == 1, [c.describe() for c in best[2048]]
    assert all(c.cp > 1 for c in best[131072]), [c.describe() for c in best[131072]]

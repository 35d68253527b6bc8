"""Pipeline parallelism: stage layouts and their errors (one process), and every schedule
trained over 2 torchrun processes against one process (one launch for all schedules)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from titanctl.errors import ParallelError
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.decoder import Transformer, split_into_stage
from titanctl.parallel.layouts.pipeline_parallel import microbatch_count, read_schedule_csv, stage_ids_for_rank
from titanctl.parallel.layouts.pipeline_stages import (
    SCHEDULES,
    check_stage_count,
    default_stages_per_rank,
    pipeline_layer_ranges,
    stage_layer_ranges,
)
from titanctl.parallel.layouts.weight_init import initialize_weights

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "distributed" / "workers" / "pp_worker.py"
REL_TOL = 1e-5
PARAM_TOL = 5e-4  # AdamW turns rounding noise in near-zero gradients into up to ~lr/200 of drift

# 2 ranks, 4 stages placed loop-style (rank 0: stages 0 and 2, rank 1: stages 1 and 3),
# 2 microbatches; full backward (B) on some stages, split input/weight backward (I, W) on others.
CSV_SCHEDULE = "0F0,0F1,2F0,2F1,2I0,2I1,2W0,2W1,0B0,0B1\n1F0,1F1,3F0,3I0,3W0,3F1,3B1,1B0,1I1,1W1\n"


def ranges(rs: list[range]) -> list[list[int]]:
    return [list(r) for r in rs]


# ---------------------------------------------------------------- layouts (no torchrun)


def test_even_split_gives_extra_layers_to_early_stages():
    assert ranges(stage_layer_ranges(4, 2)) == [[0, 1], [2, 3]]
    assert ranges(stage_layer_ranges(7, 3)) == [[0, 1, 2], [3, 4], [5, 6]]
    assert ranges(stage_layer_ranges(4, 4)) == [[0], [1], [2], [3]]


def test_split_points():
    assert ranges(stage_layer_ranges(4, None, ["layers.1"])) == [[0], [1, 2, 3]]
    assert ranges(stage_layer_ranges(6, 3, ["layers.2", "layers.5"])) == [[0, 1], [2, 3, 4], [5]]


@pytest.mark.parametrize(
    "n_layers, num_stages, points, words",
    [
        (4, None, ["layers.4"], ["layer 4", "4 layers"]),
        (4, None, ["layers.9"], ["layer 9", "4 layers"]),
        (4, None, ["norm"], ["'norm'"]),
        (4, None, ["layers.2", "layers.1"], ["layer 1", "after layer 2"]),
        (4, None, ["layers.0"], ["layer 0"]),
        (4, 3, ["layers.2"], ["2 stages", "3 stages"]),
        (3, 4, [], ["3 layers", "4 pipeline stages"]),
    ],
)
def test_stage_layer_range_errors(n_layers, num_stages, points, words):
    with pytest.raises(ParallelError) as e:
        stage_layer_ranges(n_layers, num_stages, points)
    message = str(e.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_default_stages_per_rank():
    assert [default_stages_per_rank(s) for s in SCHEDULES] == [1, 1, 2, 2, 2, 2, 2]
    for schedule, expected in [
        ("GPipe", [[0, 1], [2, 3]]),
        ("1F1B", [[0, 1], [2, 3]]),
        ("Interleaved1F1B", [[0], [1], [2], [3]]),
        ("DualPipeV", [[0], [1], [2], [3]]),
    ]:
        assert ranges(pipeline_layer_ranges(4, 2, schedule)) == expected
    assert ranges(pipeline_layer_ranges(8, 2, "LoopedBFS", layers_per_stage=2)) == [
        [0, 1], [2, 3], [4, 5], [6, 7]
    ]
    assert ranges(pipeline_layer_ranges(4, 2, "1F1B", layers_per_stage=3)) == [[0, 1, 2], [3]]
    assert ranges(pipeline_layer_ranges(4, 2, None, num_stages=4)) == [[0], [1], [2], [3]]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(schedule="1F1B", split_points=["layers.1", "layers.2"]), ["3 pipeline stages", "degree 2"]),
        (dict(schedule="GPipe", layers_per_stage=1), ["GPipe", "2 per rank"]),
        (dict(schedule="Interleaved1F1B", split_points=["layers.2"]), ["Interleaved1F1B", "give 1"]),
        (dict(schedule="LoopedBFS", layers_per_stage=2), ["LoopedBFS", "give 1"]),
        (dict(n_layers=6, schedule="ZBVZeroBubble", layers_per_stage=1), ["ZBVZeroBubble", "exactly 2"]),
        (dict(schedule="DualPipeV", split_points=["layers.2"]), ["DualPipeV", "give 1"]),
        (dict(n_layers=3, schedule="Interleaved1F1B"), ["3 layers", "4 pipeline stages"]),
        (dict(schedule="1F1B", split_points=["layers.2"], layers_per_stage=2), ["not both"]),
        (dict(schedule=None, layers_per_stage=1, num_stages=2), ["4 stages", "2 stages"]),
        (dict(schedule="Zigzag"), ["Zigzag"]),
    ],
)
def test_pipeline_layout_errors(kwargs, words):
    with pytest.raises(ParallelError) as e:
        pipeline_layer_ranges(**{"n_layers": 4, "pp_degree": 2, **kwargs})
    message = str(e.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_stage_count_per_rank():
    assert check_stage_count(8, 4, "Interleaved1F1B") == 2
    assert check_stage_count(6, 2, "LoopedBFS") == 3
    assert check_stage_count(2, 2, None) == 1


def test_stage_placement():
    assert [stage_ids_for_rank(r, 2, 4, "loop") for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_ids_for_rank(r, 4, 8, "v") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    # torch's own V mapping agrees with ours
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    mapping = generate_stage_to_rank_mapping(4, 8, style="v")
    assert all(mapping[s] == r for r in range(4) for s in stage_ids_for_rank(r, 4, 8, "v"))


@pytest.mark.parametrize(
    "args, words",
    [
        ((4, 3, "GPipe", 2, 2), ["local_batch_size 4", "microbatch_size 3"]),
        ((4, 4, "1F1B", 2, 2), ["1 microbatches", "2 stages"]),
        ((4, 2, "DualPipeV", 4, 2), ["2 microbatches", "4 stages"]),
        ((9, 1, "Interleaved1F1B", 8, 4), ["9 microbatches", "multiple of 2"]),
    ],
)
def test_microbatch_errors(args, words):
    with pytest.raises(ParallelError) as e:
        microbatch_count(*args)
    for word in words:
        assert word in str(e.value), str(e.value)


def test_microbatch_count():
    assert microbatch_count(8, 2, "1F1B", 4, 4) == 4
    assert microbatch_count(4, 4, "GPipe", 2, 2) == 1
    assert microbatch_count(8, 1, "Interleaved1F1B", 8, 4) == 8


def test_read_schedule_csv(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text(CSV_SCHEDULE)
    assert read_schedule_csv(path, 2) == ({0: 0, 2: 0, 1: 1, 3: 1}, 2)
    for text, pp, words in [
        (CSV_SCHEDULE, 4, ["2 rows", "degree is 4"]),
        ("0F0,0X0\n1F0\n", 2, ["row 1 column 2", "'0X0'"]),
        ("0F0\n1F0,1B0x\n", 2, ["row 2 column 2", "'1B0x'"]),
        ("0F0,0SEND_F0\n1F0\n", 2, ["'0SEND_F0'", "not a compute action"]),
        ("0F0,1F0\n1B0\n", 2, ["stage 1", "rank 0 and rank 1"]),
        ("0F0\n2F0\n", 2, ["stages [1]"]),
        ("0F0,0F2\n1F0\n", 2, ["skips microbatches [1]"]),
    ]:
        path.write_text(text)
        with pytest.raises(ParallelError) as e:
            read_schedule_csv(path, pp)
        for word in words:
            assert word in str(e.value), str(e.value)
    with pytest.raises(ParallelError, match="cannot read"):
        read_schedule_csv(tmp_path / "missing.csv", 2)


def test_split_into_stage_chains_to_the_whole_model():
    args = ModelArgs(dim=64, n_layers=4, n_heads=4, vocab_size=256, multiple_of=32, max_seq_len=32)
    with torch.device("meta"):
        meta = Transformer(args)
    whole = split_into_stage(meta, range(4), True, True)
    layouts = [range(1), range(1, 3), range(3, 4)]
    parts = [split_into_stage(meta, r, i == 0, i == 2) for i, r in enumerate(layouts)]
    assert parts[0].norm is None and parts[0].output is None and parts[0].tok_embeddings is not None
    assert parts[1].tok_embeddings is None and parts[1].output is None and list(parts[1].layers) == ["1", "2"]
    assert parts[2].tok_embeddings is None and parts[2].norm is not None and list(parts[2].layers) == ["3"]
    assert list(meta.layers) == ["0", "1", "2", "3"]  # the meta model is untouched
    names = [n for p in parts for n, _ in p.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in whole.named_parameters())
    for module in [whole, *parts]:
        module.to_empty(device="cpu")
        initialize_weights(module, seed=3, buffer_device=torch.device("cpu"))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    h = tokens
    for part in parts:
        h = part(h)  # (2, 16, 64) hidden states between stages, (2, 16, 256) logits at the end
    torch.testing.assert_close(h, whole(tokens), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"no layers \[7\]"):
        split_into_stage(meta, [7], True, True)


# ---------------------------------------------------------------- 2 processes


CASES = {
    **{name: {"schedule": name} for name in SCHEDULES},
    "GPipe-split-layers.1-mb2": {"schedule": "GPipe", "split_points": ["layers.1"], "microbatch_size": 2},
    "1F1B-3-layers-per-stage": {"schedule": "1F1B", "layers_per_stage": 3},
    # two pipeline steps per optimizer step: gradients must accumulate, not be rescaled
    "Interleaved1F1B-accumulate-2": {"schedule": "Interleaved1F1B", "accumulation": 2},
    "csv": {"schedule_csv": "<tmp>", "microbatch_size": 2},
}


@pytest.fixture(scope="module")
def pp_results(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("pp")
    csv_path = tmp / "schedule.csv"
    csv_path.write_text(CSV_SCHEDULE)
    cases = {k: {**v, "schedule_csv": str(csv_path)} if "schedule_csv" in v else v for k, v in CASES.items()}
    (tmp / "cases.json").write_text(json.dumps(cases))
    out = tmp / "result.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(WORKER), "--cases", str(tmp / "cases.json"), "--out", str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads(out.read_text())
    print(f"\ntorchrun with {len(cases)} pipeline cases: {elapsed:.1f} s "
          f"(reference {results['reference_seconds']:.1f} s)")
    return results["cases"]


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_matches_one_process(pp_results, case):
    r = pp_results[case]
    rel = [abs(a - b) / abs(b) for a, b in zip(r["pp_losses"], r["ref_losses"])]
    norm_rel = [abs(a - b) / abs(b) for a, b in zip(r["pp_norms"], r["ref_norms"])]
    print(
        f"{case}: {r['n_microbatches']} microbatches, stages per rank {[g['stages'] for g in r['layout']]}, "
        f"max rel loss diff {max(rel):.2e}, max rel grad-norm diff {max(norm_rel):.2e}, "
        f"max |param diff| {r['max_param_diff']:.2e} ({r['max_param_diff_name']}), {r['seconds']:.2f} s"
    )
    assert len(r["pp_losses"]) == len(r["ref_losses"]) >= 3
    assert max(rel) <= REL_TOL, (r["pp_losses"], r["ref_losses"])
    assert max(norm_rel) <= REL_TOL, (r["pp_norms"], r["ref_norms"])
    assert min(r["ref_norms"]) > 0.5  # clipping acted, so a per-stage norm would have shown
    assert r["max_param_diff"] <= PARAM_TOL
    assert r["pp_losses"][-1] != r["pp_losses"][0]  # training moved


def test_pipeline_layouts(pp_results):
    layouts = {case: [g["stages"] for g in r["layout"]] for case, r in pp_results.items()}
    assert layouts["GPipe"] == layouts["1F1B"] == [[0], [1]]
    for name in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "csv"):
        assert layouts[name] == [[0, 2], [1, 3]], name
    assert layouts["ZBVZeroBubble"] == layouts["DualPipeV"] == [[0, 3], [1, 2]]
    assert pp_results["GPipe-split-layers.1-mb2"]["layout"][1]["layers"] == {"1": [1, 2, 3]}
    assert pp_results["1F1B-3-layers-per-stage"]["layout"][0]["layers"] == {"0": [0, 1, 2]}
    assert pp_results["csv"]["n_microbatches"] == 2


def test_build_pipeline_in_one_process(tmp_path):
    """A 1-rank CSV schedule: bad schedules become ParallelError, a step needs real weights."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from titanctl.config.job_config import Parallelism
    from titanctl.parallel.layouts.pipeline_parallel import build_pipeline

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=256, multiple_of=32, max_seq_len=32)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("pp",))["pp"]

        def build(csv_text: str):
            path = tmp_path / "schedule.csv"
            path.write_text(csv_text)
            cfg = Parallelism(pipeline_parallel_degree=1, pipeline_parallel_schedule_csv=str(path))
            with torch.device("meta"):
                model = Transformer(args)
            return build_pipeline(
                model, mesh, cfg, device=torch.device("cpu"), local_batch_size=2,
                parallelize_fn=lambda m: m, loss_fn=loss_fn,
            )

        with pytest.raises(ParallelError, match="not a valid schedule"):
            build("0B0,0F0,0F1,0B1\n")  # backward before forward
        with pytest.raises(ParallelError, match="runs 1 microbatches, but local_batch_size 2"):
            build("0F0,0B0\n")
        pipe = build("0F0,0F1,0B1,0B0\n")
        assert pipe.has_first_stage and pipe.has_last_stage and pipe.n_microbatches == 2
        tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
        with pytest.raises(RuntimeError, match="meta device"):
            pipe.step(tokens[:, :-1], tokens[:, 1:])
        (part,) = pipe.model_parts
        part.to_empty(device="cpu")
        initialize_weights(part, seed=1, buffer_device=torch.device("cpu"))
        loss = pipe.step(tokens[:, :-1], tokens[:, 1:])
        grads = {n: p.grad.clone() for n, p in part.named_parameters()}
        part.zero_grad()
        expected = loss_fn(part(tokens[:, :-1]), tokens[:, 1:])
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        for n, p in part.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7)
    finally:
        dist.destroy_process_group()

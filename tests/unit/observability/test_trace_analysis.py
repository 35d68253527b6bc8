"""`titanctl inspect-trace` on torch.profiler traces: top operators, compute/communication overlap, stragglers."""

import gzip
import json
import os
import subprocess
import sys

import pytest

from titanctl.cli.app import main
from titanctl.observability.trace_analysis import (
    analyze_profiles,
    inspect_path,
    is_communication,
    read_document,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def run_cli(args, capsys):
    """The CLI in this process (fast); returns (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exc:
        main(args)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def x(name, ts, dur, tid=1, cat="cpu_op", pid=100):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": {}}


def rank0_trace():
    """Compute [0,400] and [600,800]; communication [400,450] (main thread) and [450,750] (gloo thread)."""
    return {
        "schemaVersion": 1,
        "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 100, "tid": 0, "args": {"name": "python"}},
            {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": 1, "ts": -50, "dur": 2000},
            x("ProfilerStep#1", 0, 1000, cat="user_annotation"),
            x("fwd", 0, 900, cat="user_annotation"),  # an annotation: neither compute nor communication
            x("aten::linear", 0, 400),
            x("aten::mm", 50, 300),
            x("c10d::allreduce_", 400, 50),
            x("aten::copy_", 410, 10),  # inside a collective: communication, not compute
            x("aten::relu", 600, 200),
            x("gloo:all_reduce", 450, 300, tid=2, cat="user_annotation"),
            {"ph": "i", "name": "instant", "pid": 100, "tid": 1, "ts": 5, "s": "t"},
            {"ph": "X", "name": "no duration", "pid": 100, "tid": 1, "ts": 10},  # skipped
            {"ph": "X", "name": "bad ts", "pid": 100, "tid": 1, "ts": "soon", "dur": 3},  # skipped
            "not an event",  # skipped
        ],
    }


def rank1_trace():
    """Slower compute: [0,400] and [600,1100]; communication [400,650]; begin/end events; no categories."""
    return {
        "distributedInfo": {"backend": "gloo", "rank": 1, "world_size": 2},
        "traceEvents": [
            x("ProfilerStep#1", 0, 1400, cat="user_annotation", pid=200),
            {"ph": "B", "name": "aten::linear", "pid": 200, "tid": 1, "ts": 0},
            {"ph": "B", "name": "aten::mm", "pid": 200, "tid": 1, "ts": 50},
            {"ph": "E", "pid": 200, "tid": 1, "ts": 350},
            {"ph": "E", "pid": 200, "tid": 1, "ts": 400},
            {"ph": "X", "name": "c10d::allreduce_", "pid": 200, "tid": 1, "ts": 400, "dur": 50},
            {"ph": "X", "name": "aten::relu", "pid": 200, "tid": 1, "ts": 600, "dur": 500},
            {"ph": "X", "name": "gloo:all_reduce", "pid": 200, "tid": 2, "ts": 450, "dur": 200},
        ],
    }


@pytest.fixture
def two_ranks(tmp_path):
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "rank0_trace.json").write_text(json.dumps(rank0_trace()))
    # the rank comes from distributedInfo here, not from the name; gzipped like --export .json.gz
    (folder / "other.json.gz").write_bytes(gzip.compress(json.dumps(rank1_trace()).encode()))
    (folder / "notes.txt").write_text("not a trace")
    return folder


def test_hand_built_two_ranks_exact_numbers(two_ranks):
    report = inspect_path(two_ranks).profile
    r0, r1 = report.ranks
    assert (r0.rank, r1.rank) == (0, 1)
    assert (r0.steps, r0.step_us, r0.compute_us, r0.comm_us, r0.overlap_us, r0.exposed_comm_us) == (
        1, 1000, 600, 350, 150, 200)
    assert (r1.steps, r1.step_us, r1.compute_us, r1.comm_us, r1.overlap_us, r1.exposed_comm_us) == (
        1, 1400, 900, 250, 50, 200)
    assert r0.skipped_events == 3 and r1.skipped_events == 0
    self_us = {o.name: o.self_us for o in r0.top_ops}
    assert self_us == {"aten::mm": 300, "gloo:all_reduce": 300, "fwd": 250, "aten::relu": 200,
                       "aten::linear": 100, "c10d::allreduce_": 40, "aten::copy_": 10}
    assert [o.name for o in r0.top_ops[:2]] == ["aten::mm", "gloo:all_reduce"]  # ties by name
    assert {o.name: o.self_us for o in r1.top_ops}["aten::linear"] == 100  # from a B/E pair

    # medians over 2 ranks: compute 750 (rank 1: +20%), step 1200 (rank 1: +16.7%); threshold 10%
    assert report.median_compute_us == 750 and report.median_step_us == 1200
    assert [(s.rank, s.metric) for s in report.stragglers] == [(1, "compute"), (1, "step")]
    assert report.stragglers[0].pct_above_median == pytest.approx(20.0)
    assert report.stragglers[1].pct_above_median == pytest.approx(100 * (1400 / 1200 - 1))
    # a 25% threshold lets both ranks pass
    docs = [(p, read_document(p)) for p in sorted(two_ranks.glob("*.json*"))]
    assert analyze_profiles(docs, threshold_pct=25).stragglers == []


def test_cli_json_and_tables(two_ranks, capsys):
    code, out, _ = run_cli(["inspect-trace", str(two_ranks), "--json", "--top", "3"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["flight_recorder"] is None
    assert [len(r["top_ops"]) for r in data["profile"]["ranks"]] == [3, 3]
    assert [s["rank"] for s in data["profile"]["stragglers"]] == [1, 1]
    assert data["skipped"] == [str(two_ranks / "notes.txt")]

    code, out, _ = run_cli(["inspect-trace", str(two_ranks)], capsys)
    assert code == 0
    assert "rank 1 is a straggler: compute time 900.0 µs is 20.0% above the median 750.0 µs" in out
    assert "gloo:all_reduce" in out and "communication" in out


def test_real_profiler_trace_top_ops(tmp_path, capsys):
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    a = torch.randn(96, 96)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            with record_function("block"):
                b = torch.relu(a @ a)
    prof.export_chrome_trace(str(tmp_path / "rank0_trace.json"))
    assert b.shape == (96, 96)

    code, out, _ = run_cli(["inspect-trace", str(tmp_path / "rank0_trace.json"), "--json", "--top", "50"], capsys)
    assert code == 0
    (rank,) = json.loads(out)["profile"]["ranks"]
    ops = {o["name"]: o for o in rank["top_ops"]}
    assert ops["aten::mm"]["calls"] == 5 and ops["aten::relu"]["calls"] == 5
    assert ops["aten::matmul"]["total_us"] >= ops["aten::mm"]["total_us"] > 0
    assert 0 <= ops["aten::matmul"]["self_us"] < ops["aten::matmul"]["total_us"]  # mm is its child
    assert rank["timeline"] == "cpu" and rank["comm_us"] == 0 and rank["compute_us"] > 0

    code, out, _ = run_cli(["inspect-trace", str(tmp_path), "--top", "3"], capsys)
    assert code == 0 and "top 3 operators by self time" in out and "aten::mm" in out


def test_communication_rule():
    for name in ["gloo:all_reduce", "nccl:all_gather", "c10d::allreduce_", "record_param_comms",
                 "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "_c10d_functional::reduce_scatter_tensor",
                 "c10d::send", "nccl:recv 0<-1", "barrier", "all_to_all_single"]:
        assert is_communication(name), name
    for name in ["aten::mm", "aten::broadcast_tensors", "aten::_foreach_add_", "ProfilerStep#3", "sendfile_helper"]:
        assert not is_communication(name), name


def test_corrupt_file_is_one_line_error(tmp_path):
    bad = tmp_path / "rank0_trace.json"
    bad.write_text(json.dumps(rank0_trace())[:200])  # truncated while being written
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-m", "titanctl", "inspect-trace", str(bad)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "corrupt JSON" in lines[0] and "rank0_trace.json" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("content, message", [
    (b'{"hello": 1}', "not a torch.profiler trace nor a Flight Recorder dump"),
    (b"\x1f\x8b\x08garbage", "corrupt gzip"),
    (b"plain text", "neither JSON nor a pickle"),
])
def test_unreadable_inputs(tmp_path, capsys, content, message):
    path = tmp_path / "trace.json"
    path.write_bytes(content)
    code, _, err = run_cli(["inspect-trace", str(path)], capsys)
    assert code == 2 and message in err


def test_missing_path_and_empty_folder(tmp_path, capsys):
    code, _, err = run_cli(["inspect-trace", str(tmp_path / "nope")], capsys)
    assert code == 2 and "does not exist" in err
    code, _, err = run_cli(["inspect-trace", str(tmp_path)], capsys)
    assert code == 2 and "no torch.profiler traces or Flight Recorder dumps found" in err


def test_no_torch_at_import_time():
    code = ("import sys, titanctl.cli.app, titanctl.cli.inspect_trace, titanctl.observability.trace_analysis, "
            "titanctl.parallel.runtime.hang_watchdog; assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": REPO}, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_gzip_bomb_is_decompressed_only_up_to_the_bound(tmp_path):
    """64 MiB of JSON in 64 KB of gzip, read with a 1 MiB bound: refused before 2 MiB were held."""
    import tracemalloc

    from titanctl.errors import TraceError

    bomb = tmp_path / "rank0_trace.json.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as f:
        f.write(b'{"traceEvents": [')
        for _ in range(64):
            f.write(b" " * (1 << 20))
        f.write(b"]}")
    assert bomb.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(TraceError, match=r"decompresses to more than 1 MiB: raise --max-size-mib"):
            read_document(bomb, max_mib=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"peak {peak / 2**20:.1f} MiB"
    assert read_document(bomb, max_mib=65) == {"traceEvents": []}  # a raised bound reads it


def test_plain_file_over_the_bound(tmp_path):
    from titanctl.errors import TraceError

    big = tmp_path / "rank0_trace.json"
    big.write_bytes(b'{"traceEvents": [' + b" " * (1 << 20) + b"]}")
    with pytest.raises(TraceError, match=r"rank0_trace.json is larger than 1 MiB: raise --max-size-mib"):
        read_document(big, max_mib=1)


@pytest.mark.parametrize("kind", ["json", "pickle-name", "dump-sizes"])
def test_deep_nesting_is_one_line_naming_the_file(tmp_path, capsys, kind):
    import pickle

    path = tmp_path / "rank0_trace.json"
    if kind == "json":
        path.write_text("[" * 100_000 + "]" * 100_000)
    else:
        if kind == "pickle-name":  # a trace event whose name is 100k lists deep: str() of it recurses
            doc = {"traceEvents": [{"ph": "X", "name": "DEEP", "ts": 0, "dur": 1, "pid": 1, "tid": 1}]}
        else:  # a Flight Recorder dump with nested input sizes
            doc = {"entries": [{"collective_seq_id": 1, "profiling_name": "nccl:all_reduce",
                                "input_sizes": "DEEP", "state": "completed"}], "pg_config": {}}
        # pickle.dumps itself recurses, so the deep list is spliced in as opcodes: MARK x n, EMPTY_LIST,
        # LIST x n builds n + 1 nested lists, which the unpickler's stack machine reads without recursing.
        raw = pickle.dumps(doc, protocol=2)
        placeholder = b"X\x04\x00\x00\x00DEEP"
        assert raw.count(placeholder) == 1
        path.write_bytes(raw.replace(placeholder, b"(" * 100_000 + b"]" + b"l" * 100_000))
    code, out, err = run_cli(["inspect-trace", str(path)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and str(path) in err, err
    assert "nested" in err

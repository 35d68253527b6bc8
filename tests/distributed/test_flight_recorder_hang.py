"""Flight Recorder: a real gloo hang is dumped by every rank, and `titanctl inspect-trace` names the culprit.

Plus hand-written dumps for the mismatches a hang test cannot produce on purpose.
"""

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from titanctl.cli.app import main
from titanctl.errors import TraceError
from titanctl.observability.trace_analysis import inspect_path
from titanctl.parallel.runtime.hang_watchdog import CollectiveWatchdog

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "workers" / "fr_hang_worker.py"


def worker_env():
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    return env


def test_real_gloo_hang_names_the_skipping_rank(tmp_path):
    dumps = tmp_path / "fr"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
           str(WORKER), str(dumps)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=worker_env(),
                            start_new_session=True)
    try:
        # ~8 s on 2 idle cores (4 torch imports dominate), ~20 s when other jobs share them
        log, _ = proc.communicate(timeout=45)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the job
        log, _ = proc.communicate()
        pytest.fail(f"hang worker did not finish in 45 s:\n{log[-3000:]}")
    assert proc.returncode == 0, log[-3000:]
    assert sorted(p.name for p in dumps.iterdir()) == ["rank0.json", "rank1.json", "rank2.json"], log[-3000:]

    cli = [sys.executable, "-m", "titanctl", "inspect-trace", str(dumps)]
    shown = subprocess.run(cli, capture_output=True, text=True, env=worker_env(), timeout=60)
    print(shown.stdout)
    assert shown.returncode == 0, shown.stderr
    assert ("process group 0 (default_pg, ranks 0-2): collective #5 all_reduce [1024] — rank 1 never entered it "
            "(its last collective is #4 broadcast [1024]); ranks 0,2 are waiting in #5") in shown.stdout
    assert "process group 1 (pair, ranks 0,1): all ranks agree on collectives #1..#1" in shown.stdout

    report = inspect_path(dumps).flight_recorder  # what --json prints
    assert report.culprits == [1]
    (bad,) = [g for g in report.groups if g.mismatch]
    assert (bad.mismatch.kind, bad.mismatch.seq, bad.mismatch.waiting) == ("missing", 5, [0, 2])
    assert bad.mismatch.expected == "all_reduce [1024]"


# ---------------------------------------------------------------------------------- hand-written dumps


def entry(seq, op="all_reduce", sizes=((1024,),), pg=("0", "default_pg"), dtype="Float", state="scheduled"):
    return {"collective_seq_id": seq, "profiling_name": f"gloo:{op}", "process_group": list(pg),
            "input_sizes": [list(s) for s in sizes], "input_dtypes": [dtype] * len(sizes), "state": state,
            "is_p2p": False, "pg_id": int(pg[0]), "record_id": seq - 1}


def write_dumps(folder, per_rank, ranks_text=None, pickled=False):
    folder.mkdir(exist_ok=True)
    n = len(per_rank)
    for rank, entries in enumerate(per_rank):
        config = {"0": {"name": "0", "desc": "default_pg", "ranks": ranks_text or str(list(range(n)))}}
        doc = {"version": "2.10", "pg_config": config, "pg_status": {}, "entries": entries}
        if pickled:
            (folder / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(doc))
        else:
            (folder / f"rank{rank}.json").write_text(json.dumps(doc))
    return folder


def common():
    return [entry(1), entry(2, "broadcast"), entry(3)]


def test_different_op_at_same_seq(tmp_path):
    ok = common()
    folder = write_dumps(tmp_path / "d", [ok + [entry(4)], ok + [entry(4, "broadcast")], ok + [entry(4)]])
    report = inspect_path(folder).flight_recorder
    (group,) = report.groups
    m = group.mismatch
    assert (m.kind, m.seq, m.culprits, m.reference_ranks, m.ambiguous) == ("op", 4, [1], [0, 2], False)
    assert m.found == {1: "broadcast [1024]"}
    assert group.message == ("process group 0 (default_pg, ranks 0-2): collective #4 all_reduce [1024] — rank 1 "
                             "entered it with a different op (rank 1: broadcast [1024]); ranks 0-2 are waiting in #4")
    assert report.culprits == [1]


def test_different_shape_at_same_seq(tmp_path):
    ok = common()
    ranks = [ok + [entry(4)] + [entry(5)] for _ in range(4)]
    ranks[3][3] = entry(4, sizes=((512,),))  # rank 3 all_reduces a tensor of another shape
    del ranks[3][4:]
    report = inspect_path(write_dumps(tmp_path / "d", ranks)).flight_recorder
    m = report.groups[0].mismatch
    assert (m.kind, m.seq, m.culprits, m.waiting) == ("sizes", 4, [3], [3])
    assert "collective #4 all_reduce [1024] — rank 3 entered it with different input sizes (rank 3: all_reduce [512])" \
        in report.groups[0].message
    notes = {s.rank: s.note for s in report.groups[0].ranks_state}
    assert notes == {0: "went past #4", 1: "went past #4", 2: "went past #4", 3: "entered #4 with different sizes"}


def test_two_ranks_disagree_without_majority(tmp_path):
    ok = common()
    folder = write_dumps(tmp_path / "d", [ok + [entry(4, dtype="Float")], ok + [entry(4, dtype="BFloat16")]])
    m = inspect_path(folder).flight_recorder.groups[0].mismatch
    assert (m.kind, m.culprits, m.reference_ranks, m.ambiguous) == ("dtypes", [1], [0], True)


def test_missing_collective_with_ring_buffer_and_guessed_groups(tmp_path, capsys):
    # rank 0's buffer dropped #1; gloo's placeholder pg_config has no ranks; ranks come from the file names
    per_rank = [[entry(2, "broadcast"), entry(3), entry(4)], common(), common() + [entry(4)]]
    folder = write_dumps(tmp_path / "d", per_rank, ranks_text="[]", pickled=True)
    with pytest.raises(SystemExit) as exc:
        main(["inspect-trace", str(folder)])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert ("collective #4 all_reduce [1024] — rank 1 never entered it (its last collective is #3 all_reduce "
            "[1024]); ranks 0,2 are waiting in #4") in out
    assert "members guessed" in out and "dropped from the ring buffer" in out


def test_healthy_nccl_like_dump(tmp_path):
    done = [entry(1, state="completed"), entry(2, state="completed"), entry(3, state="started")]
    report = inspect_path(write_dumps(tmp_path / "d", [done, done])).flight_recorder
    assert report.culprits == [] and report.groups[0].mismatch is None
    assert report.groups[0].message.endswith("all ranks agree on collectives #1..#3; ranks 0,1 still in their last collective")


def test_pickle_with_objects_is_refused(tmp_path, capsys):
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "rank0").write_bytes(pickle.dumps({"entries": [], "pg_config": {}, "version": "2.10", "x": Path("/")}))
    with pytest.raises(SystemExit) as exc:
        main(["inspect-trace", str(folder / "rank0")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "refusing to unpickle pathlib" in err


def test_duplicate_rank_dumps(tmp_path):
    folder = write_dumps(tmp_path / "d", [common(), common()])
    (folder / "rank1.json").rename(folder / "again_rank0.json")
    doc = json.loads((folder / "again_rank0.json").read_text())
    (folder / "again_rank0.json").write_text(json.dumps({**doc, "rank": 0}))
    with pytest.raises(TraceError, match="two Flight Recorder dumps claim rank 0"):
        inspect_path(folder)


def test_watchdog_fires_once_and_only_when_late():
    calls = []
    wd = CollectiveWatchdog(0.2, lambda label, elapsed: calls.append((label, elapsed)), poll_s=0.05)
    with wd.watch("fast"):
        pass
    time.sleep(0.3)
    assert calls == []
    with wd.watch("slow"):
        assert wd.fired.wait(5)
        time.sleep(0.3)  # still inside: no second call
    wd.close()
    assert [c[0] for c in calls] == ["slow"] and calls[0][1] >= 0.2
    assert not any(t.name == "titanctl-collective-watchdog" for t in threading.enumerate())


def test_enable_and_dump_without_process_group(tmp_path, monkeypatch):
    from titanctl.parallel.runtime import hang_watchdog as runtime

    for var in ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    env = runtime.enable(128, dump_folder=tmp_path / "fr")
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "128" == env["TORCH_FR_BUFFER_SIZE"]
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "fr" / "nccl" / "rank")
    assert not (tmp_path / "fr").exists(), "enable() writes nothing: the run may still be refused"
    with pytest.raises(ValueError):
        runtime.enable(-1)

    path = runtime.dump(tmp_path / "fr", 3, reason="manual")
    assert path == tmp_path / "fr" / "rank3.json"
    assert sorted(p.name for p in path.parent.iterdir()) == ["rank3.json"]  # no temporary left
    doc = json.loads(path.read_text())
    assert doc["rank"] == 3 and doc["titanctl"]["reason"] == "manual" and "pg_config" in doc
    report = inspect_path(path).flight_recorder
    assert report.groups == [] and "hold no collectives" in report.summary[0]

"""Hostile structure in files titanctl reads (issue 27, class 4, and the Meta raw pickle of class 8):
deep pickles and JSON, files far larger than what they claim to hold, a foreign config declaring a
model its tensors do not have, FIFOs and folders of tens of thousands of files. Each is one red line
on stderr and exit code 2, no crash, bounded memory and time, and the files read are left as they were.

Every case runs the titanctl binary (``run`` measures its peak resident memory); crafted files are made
here from the shared trained run (``trained_run``), copied, never changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.cli_server import titanctl_run
from tests.conftest import OFFLINE_ENV, TRUSTED_RUN
from tests.unit.checkpoint.test_checkpoint_trust import (
    STEP,
    clone,
    error_line,
    infer_args,
    read_index,
    rerecord_checksums,
    rewrite,
    run,
    tree_hash,
    write_index,
)

DEEP = 10**6  # nesting levels of a crafted pickle (10^5 already killed convert in the report)
DEEP_JSON = 10**5
GIB = 2**30
PEAK_MIB = 1024  # a refused file was never read whole nor sized anything: the process stays below this
NESTED = r"refusing to unpickle values nested deeper than 64 levels"


def deep_tuple_in_place_of(data: bytes, marker: str) -> bytes:
    """``data`` (a pickle) with the string ``marker`` replaced by a DEEP-level nested tuple, built with
    one opcode per level (pickle.dumps itself would recurse)."""
    text = marker.encode()
    for needle in (b"\x8c" + bytes([len(text)]) + text, b"X" + len(text).to_bytes(4, "little") + text):
        if data.count(needle) == 1:  # SHORT_BINUNICODE (protocol 4) or BINUNICODE (2, torch.save's)
            return data.replace(needle, b")" + b"\x85" * DEEP)
    raise AssertionError(f"{marker!r} is not once in the pickle")


def deep_json(value: dict) -> str:
    """``value`` as JSON with one more key holding a list nested DEEP_JSON levels."""
    return json.dumps(value)[:-1] + ', "deep": ' + "[" * DEEP_JSON + "]" * DEEP_JSON + "}"


def sparse(path: Path, size: int) -> Path:
    """A file of ``size`` bytes that takes no disk space (a hole)."""
    with open(path, "ab") as f:
        f.truncate(size)
    return path


def fingerprint(folder: Path) -> str:
    """tree_hash for folders with sparse multi-GiB files: those by size and modification time (a write
    changes both), every other file by its bytes."""
    digest = hashlib.sha256()
    for path in sorted(Path(folder).rglob("*")):
        stat = path.lstat()
        digest.update(f"{path.relative_to(folder)} {stat.st_size} {stat.st_mode}".encode())
        if path.is_file() and stat.st_size > 64 * 2**20:
            digest.update(str(stat.st_mtime_ns).encode())
        elif path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def torchtitan_step(trained_run: Path, root: Path) -> Path:
    """The run's step-2 without titanctl.json: a foreign (torchtitan) DCP folder, which has no checksums."""
    step = clone(trained_run, root / "run") / STEP
    (step / "titanctl.json").unlink()
    return step


def titanctl_bounded(args: list, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    """The titanctl binary with a time limit (where a hang was the bug): (process, seconds it took)."""
    start = time.monotonic()
    try:
        proc = titanctl_run([*map(str, args)], timeout=timeout,
                              env={**os.environ, **OFFLINE_ENV})
    except subprocess.TimeoutExpired:
        pytest.fail(f"titanctl {' '.join(map(str, args[:2]))} did not exit within {timeout} s")
    return proc, time.monotonic() - start


@pytest.fixture(scope="module")
def foreign(foreign_formats) -> dict[str, Path]:
    """The run's step-2 weights as a Hugging Face folder (with an index) and as a Meta folder."""
    return foreign_formats


# ----------------------------------------------------------------------------- deep pickles

DEEP_PICKLE_PATHS = {
    "convert": lambda case, step: ["convert", step, case / "out", "--to", "hf"],
    "infer_tp": lambda case, step: infer_args(step),
    "resume": lambda case, step: ["train", *TRUSTED_RUN, "--training.steps", "3", "--job.dump_folder", case / "run"],
}


@pytest.mark.parametrize("path", sorted(DEEP_PICKLE_PATHS))
def test_a_deeply_nested_dcp_index_is_one_line_not_a_crash(trained_run, tmp_path, path):
    """A 10^6-deep tuple as a dict key in .metadata (checksums re-recorded, as a careful attacker does):
    the C unpickler hashed it recursively and the interpreter died with SIGSEGV."""
    step = clone(trained_run, tmp_path / "run") / STEP
    index = read_index(step)
    index.planner_data = {"__DEEP__": 1}
    rewrite(step / ".metadata", deep_tuple_in_place_of(pickle.dumps(index), "__DEEP__"))
    rerecord_checksums(step)
    before = tree_hash(tmp_path / "run" / "checkpoint")
    proc, peak = run(DEEP_PICKLE_PATHS[path](tmp_path, step))
    assert re.search(rf"step-\d/\.metadata: {NESTED}", error_line(proc))
    assert tree_hash(tmp_path / "run" / "checkpoint") == before
    assert peak < PEAK_MIB


def test_a_deeply_nested_flight_recorder_pickle_is_one_line_not_a_crash(tmp_path):
    dump = {"version": "2.7", "pg_config": {}, "entries": [], "__DEEP__": 1}
    path = tmp_path / "rank0.pkl"
    path.write_bytes(deep_tuple_in_place_of(pickle.dumps(dump, protocol=4), "__DEEP__"))
    proc, peak = run(["inspect-trace", path])
    assert re.search(rf"rank0\.pkl: {NESTED}", error_line(proc))
    assert peak < PEAK_MIB


def test_a_deeply_nested_non_tensor_item_is_one_line_not_a_crash(trained_run, tmp_path):
    """The item's torch.save archive holds a pickle whose dict has a 10^6-deep key."""
    import io
    import zipfile

    from torch.distributed.checkpoint.metadata import MetadataIndex

    step = clone(trained_run, tmp_path / "run") / STEP
    buffer = io.BytesIO()
    torch.save({"__DEEP__": 1}, buffer)
    archive = zipfile.ZipFile(buffer)
    crafted = io.BytesIO()
    with zipfile.ZipFile(crafted, "w", zipfile.ZIP_STORED) as out:
        for info in archive.infolist():
            data = archive.read(info)
            out.writestr(info, deep_tuple_in_place_of(data, "__DEEP__") if info.filename.endswith("data.pkl") else data)
    index = read_index(step)
    info = index.storage_data[MetadataIndex("train_state.step")]
    old = (step / info.relative_path).read_bytes()
    rewrite(step / info.relative_path, old + crafted.getvalue())
    info.offset, info.length = len(old), len(crafted.getvalue())
    write_index(step, index)
    rerecord_checksums(step)
    proc, peak = run(["convert", step, tmp_path / "out", "--to", "hf"])
    assert re.search(rf"__0_0\.distcp \(item 'train_state\.step'\): {NESTED}", error_line(proc))
    assert not (tmp_path / "out").exists() and peak < PEAK_MIB


# ----------------------------------------------------------------------------- deep JSON


def _deep_hf_config(folder: Path) -> None:
    rewrite(folder / "config.json", deep_json(json.loads((folder / "config.json").read_text())).encode())


def _deep_hf_index(folder: Path) -> None:
    index = folder / "model.safetensors.index.json"
    rewrite(index, deep_json(json.loads(index.read_text())).encode())


def _deep_params(folder: Path) -> None:
    rewrite(folder / "params.json", deep_json(json.loads((folder / "params.json").read_text())).encode())


DEEP_JSON_FILES = {
    "hf-config.json": ("hf", _deep_hf_config, r"config\.json nests deeper than 64 levels"),
    "hf-index": ("hf", _deep_hf_index, r"model\.safetensors\.index\.json nests deeper than 64 levels"),
    "meta-params.json": ("meta", _deep_params, r"params\.json nests deeper than 64 levels"),
}


@pytest.mark.parametrize("name", sorted(DEEP_JSON_FILES))
def test_deeply_nested_json_in_a_foreign_checkpoint_is_one_line(foreign, tmp_path, name):
    """A RecursionError traceback before."""
    fmt, craft, message = DEEP_JSON_FILES[name]
    folder = tmp_path / fmt
    shutil.copytree(foreign[fmt], folder)
    craft(folder)
    before = tree_hash(folder)
    proc, _ = run(["convert", folder, tmp_path / "out", "--to", "dcp"])
    assert re.search(message, error_line(proc))
    assert tree_hash(folder) == before and not (tmp_path / "out").exists()


def test_deeply_nested_trace_json_is_one_line(tmp_path):
    (tmp_path / "rank0_trace.json").write_text(deep_json({"traceEvents": []}))
    proc, _ = run(["inspect-trace", tmp_path / "rank0_trace.json"])
    assert re.search(r"rank0_trace\.json: JSON nested too deeply to be a trace or a dump", error_line(proc))


def test_a_deeply_nested_row_of_an_hf_folder_is_one_line_before_training(tmp_path):
    """The row's 10^5-deep list killed training with SIGSEGV and no output (issue 46)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "train.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + deep_json({"text": "x"}) + "\n")
    proc, peak = run(["train", *TRUSTED_RUN, "--training.dataset", f"hf:{folder}", "--job.dump_folder", tmp_path / "run"])
    assert re.search(r"corpus/train\.jsonl: line 2 nests deeper than 64 levels$", error_line(proc))
    assert peak < PEAK_MIB and not (tmp_path / "run" / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- files larger than they should be


def _huge_index(step: Path) -> str:
    sparse(step / ".metadata", 3 * GIB)  # the real index, then a 3 GiB hole
    return r"DCP index .*step-2/\.metadata has 3,221,225,472 bytes; at most 1,073,741,824 are read"


def _huge_item(step: Path) -> str:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    index = read_index(step)
    info = index.storage_data[MetadataIndex("train_state.step")]
    info.relative_path, info.offset, info.length = "__big.distcp", 0, 3 * GIB
    sparse(step / "__big.distcp", 3 * GIB)
    write_index(step, index)
    return r"non-tensor item 'train_state\.step' stores 3,221,225,472 bytes; at most 268,500,992 are read"


def _overlong_chunk(step: Path) -> str:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    index = read_index(step)
    info = index.storage_data[MetadataIndex("tok_embeddings.weight", (0, 0))]
    data = (step / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    (step / "__big.distcp").write_bytes(data)
    sparse(step / "__big.distcp", 3 * GIB)
    info.relative_path, info.offset, info.length = "__big.distcp", 0, 3 * GIB
    write_index(step, index)
    return (r"the chunk of tensor 'tok_embeddings\.weight' at \(0, 0\) stores 3,221,225,472 bytes, more than its "
            r"size \(4352, 256\) needs")


BIG_FILES = {"index": _huge_index, "non-tensor-item": _huge_item, "tensor-chunk": _overlong_chunk}


@pytest.mark.parametrize("name", sorted(BIG_FILES))
def test_a_3gib_file_of_a_checkpoint_without_checksums_is_refused_before_it_is_read(trained_run, tmp_path, name):
    """Sparse files: each was read whole (3 GiB resident) before any check."""
    step = torchtitan_step(trained_run, tmp_path)
    message = BIG_FILES[name](step)
    before = fingerprint(step)
    proc, peak = run(["convert", step, tmp_path / "out", "--to", "hf"])
    assert re.search(message, error_line(proc))
    assert peak < PEAK_MIB, f"peak RSS {peak:.0f} MiB: the file was read"
    assert fingerprint(step) == before and not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- a foreign config declaring a bigger model


def test_a_hugging_face_config_declaring_a_billion_wide_mlp_is_refused_before_allocating(foreign, tmp_path):
    """intermediate_size 10^9 (the tensors have 768): infer-tp died allocating it (a traceback), and
    checkpoint.initial_load_path accepted the config."""
    folder = tmp_path / "hf"
    shutil.copytree(foreign["hf"], folder)
    config = json.loads((folder / "config.json").read_text())
    rewrite(folder / "config.json", json.dumps({**config, "intermediate_size": 10**9}).encode())
    before = tree_hash(folder)
    message = (r"config\.json declares a model of [\d,]+ parameters \(.*ffn width 1,000,000,000.*\), but the "
               r"checkpoint stores [\d,]+ values")
    proc, peak = run(infer_args(folder))
    assert re.search(message, error_line(proc))
    assert peak < PEAK_MIB
    proc, _ = run(["train", *TRUSTED_RUN, "--job.dump_folder", tmp_path / "fresh",
                   "--checkpoint.initial_load_path", folder, "--checkpoint.initial_load_model_weights_only"])
    assert re.search(message, error_line(proc))
    assert tree_hash(folder) == before


# ----------------------------------------------------------------------------- FIFOs and many files


def test_a_fifo_given_as_a_trace_is_one_line_not_a_hang(tmp_path):
    fifo = tmp_path / "rank0_trace.json"
    os.mkfifo(fifo)
    proc, _ = titanctl_bounded(["inspect-trace", fifo], timeout=20)
    assert re.search(r"rank0_trace\.json is not a regular file", error_line(proc))


def test_inspect_trace_on_30000_small_files_ends(tmp_path):
    """The file lookup was quadratic: 10^4 files took 80 s, 3x10^4 did not end in 10 minutes."""
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(30_000):
        (folder / f"f{i}.json").write_text("{}")
    proc, seconds = titanctl_bounded(["inspect-trace", folder], timeout=60)
    assert re.search(r"many: no torch\.profiler traces or Flight Recorder dumps found", error_line(proc))


# ----------------------------------------------------------------------------- Meta raw pickles (class 8)


def test_a_meta_shard_that_is_a_raw_pickle_is_refused_in_one_line(foreign, tmp_path):
    """Not a torch.save zip archive: torch printed a UserWarning and a source line before the one line."""
    folder = tmp_path / "meta"
    shutil.copytree(foreign["meta"], folder)
    rewrite(folder / "consolidated.00.pth", pickle.dumps({"tok_embeddings.weight": torch.zeros(2, 2)}, protocol=4))
    before = tree_hash(folder)
    env = {**os.environ, **OFFLINE_ENV, "PYTHONWARNINGS": "default"}
    proc = titanctl_run(["convert", str(folder), str(tmp_path / "out"), "--to", "hf"], env=env, timeout=120)
    assert re.search(r"consolidated\.00\.pth is a bare pickle, not a torch\.save file", error_line(proc))
    assert "Warning" not in proc.stderr
    assert tree_hash(folder) == before and not (tmp_path / "out").exists()


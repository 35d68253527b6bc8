"""Structure limits checked in-process (issue 27, class 4): the pickle scan that runs before every
unpickler, the sizes a DCP index may declare, foreign JSON, the model a foreign config may declare,
and inspect-trace's file count. The same attacks through the binary are in
tests/cli/test_hostile_structure.py; deep pickles are only scanned here, never unpickled (the
unpickler is what crashes on them)."""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import threading
import zipfile
from pathlib import Path

import pytest
import torch

from titanctl.errors import CheckpointError, TitanError, TraceError

STEP = Path("checkpoint") / "step-2"


def refused(data: bytes, **limits) -> str:
    from titanctl.safe_io import check_pickle

    with pytest.raises(TitanError) as caught:
        check_pickle(data, what="crafted.pkl", **limits)
    return str(caught.value)


def deep_tuple_key(depth: int) -> bytes:
    """{((...(),...),): 1}: a dict whose key is a tuple nested ``depth`` levels (one opcode a level)."""
    return b"\x80\x04}" + b")" + b"\x85" * depth + b"K\x01s."


def chain_by_mutation(length: int) -> bytes:
    """``length`` empty lists, memoized, then each appended into the one before it: a chain as deep as it is
    long, though the unpickler's stack never holds more than three values."""
    ops = bytearray(b"\x80\x04")
    for _ in range(length):
        ops += b"]\x940"  # EMPTY_LIST, MEMOIZE (the next memo index), POP
    for i in range(length - 1):
        ops += b"j" + i.to_bytes(4, "little") + b"j" + (i + 1).to_bytes(4, "little") + b"a0"  # memo[i].append(memo[i+1])
    return bytes(ops + b"N.")


def torch_saved_pickle(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    archive = zipfile.ZipFile(buffer)
    return archive.read(next(name for name in archive.namelist() if name.endswith("data.pkl")))


# ----------------------------------------------------------------------------- the pickle scan


def test_pickles_titanctl_and_torch_write_pass_the_scan(trained_run):
    from titanctl.safe_io import check_pickle

    plain = {"a": [1, 2.5, (3, None)], "b": {1, 2}, "c": frozenset({"x"}), "d": collections.OrderedDict(k=b"v"),
             "e": True, "f": 2**100, "g": "é" * 300, "h": list(range(5000)), "i": {n: str(n) for n in range(3000)}}
    index = (trained_run / STEP / ".metadata").read_bytes()
    check_pickle(index, what=".metadata")  # every DCP metadata class, as titanctl writes them
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        check_pickle(pickle.dumps(plain, protocol=protocol), what="plain")
        check_pickle(pickle.dumps(pickle.loads(index), protocol=protocol), what="index")
    check_pickle(torch_saved_pickle({"step": 3, "tokens": list(range(100)), "groups": collections.OrderedDict(a={1})}),
                 what="item")
    nested = 1
    for _ in range(63):
        nested = [nested]
    check_pickle(pickle.dumps({"sizes": nested}), what="64 levels")  # the limit itself is allowed


@pytest.mark.parametrize(
    "data, limits, message",
    [
        (deep_tuple_key(10**6), {}, r"values nested deeper than 64 levels"),  # SIGSEGV in hash() before
        (b"\x80\x04(0" + deep_tuple_key(10**5)[2:], {}, r"values nested deeper than 64 levels"),  # POP takes the MARK
        (chain_by_mutation(1000), {}, r"a container changed after it was put inside another"),
        (b"\x80\x04]\x94h\x00a.", {}, r"a container that contains itself"),
        (b"\x80\x04Nr\xff\xff\xff\x7f.", {}, r"a memo index 2,147,483,647 out of sequence"),  # 16 GiB of memo table
        (b"\x80\x04cbuiltins\nset\n}b.", {}, r"a change to an imported class or function"),
        (b"\x80\x04" + b"(" * 100 + b".", {}, r"values nested deeper than 64 levels"),
        (b"\x80\x04" + b"]0" * 3000 + b".", {"max_values": 1000}, r"more than 1,000 containers, objects and memo"),
        (b"\x80\x04" + b"N" * ((1 << 22) + 1) + b".", {}, r"more than 4,194,304 values on its stack"),
    ],
    ids=["deep-key", "pop-mark-then-deep-key", "chain", "self", "memo-index", "class-change", "marks", "values", "stack"],
)
def test_the_scan_refuses_what_the_unpickler_cannot_survive(data, limits, message):
    import re

    assert re.search(rf"^crafted\.pkl: refusing to unpickle {message}", refused(data, **limits))


def test_the_scan_leaves_garbage_to_the_unpickler():
    from titanctl.safe_io import check_pickle

    for garbage in (b"", b"\x00\x01garbage", b"\x80\x04s", b"\x80\x04e", b"\x80\x04h\x05."):
        check_pickle(garbage, what="garbage")  # malformed, not hostile: the unpickler says so


# ----------------------------------------------------------------------------- DCP index sizes


def _index(trained_run):
    from titanctl.checkpoint.trust.unpickle import load_dcp_index

    return load_dcp_index(trained_run / STEP / ".metadata")


def test_a_chunk_storing_more_than_its_size_needs_is_refused(trained_run):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from titanctl.checkpoint.trust.unpickle import ARCHIVE_OVERHEAD_BYTES, check_index

    index = _index(trained_run)
    info = index.storage_data[MetadataIndex("norm.weight", (0,))]
    info.length = 256 * 4 + ARCHIVE_OVERHEAD_BYTES + 1  # (256,) float32 and more than an archive's overhead
    with pytest.raises(CheckpointError, match=r"the chunk of tensor 'norm\.weight' at \(0,\) stores 66,561 bytes, "
                                              r"more than its size \(256,\) needs \(1,024 \+ 65,536 of archive\)"):
        check_index(index, Path("step-2/.metadata"))
    info.length -= 1
    check_index(index, Path("step-2/.metadata"))


def test_a_non_tensor_item_over_the_cap_is_refused_before_it_is_read(trained_run):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from titanctl.checkpoint.trust.unpickle import ARCHIVE_OVERHEAD_BYTES, MAX_PLAIN_ITEM_BYTES, check_index

    index = _index(trained_run)
    index.storage_data[MetadataIndex("train_state.step")].length = MAX_PLAIN_ITEM_BYTES + ARCHIVE_OVERHEAD_BYTES + 1
    with pytest.raises(CheckpointError, match=r"non-tensor item 'train_state\.step' stores 268,500,993 bytes"):
        check_index(index, Path("step-2/.metadata"))


def test_a_fifo_as_the_dcp_index_is_refused_without_blocking(tmp_path):
    from titanctl.checkpoint.trust.unpickle import load_dcp_index

    fifo = tmp_path / ".metadata"
    os.mkfifo(fifo)
    outcome: list = []

    def load() -> None:
        try:
            load_dcp_index(fifo)
        except CheckpointError as e:
            outcome.append(str(e))

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():  # blocked in open(): give it a writer so that the thread can end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading a FIFO as .metadata blocked")
    assert outcome and outcome[0].endswith(".metadata is not a regular file"), outcome


# ----------------------------------------------------------------------------- foreign JSON and the model it declares


@pytest.mark.parametrize("content, message", [
    ('{"dim": ' + "[" * 100_000 + "]" * 100_000 + "}", r"params\.json nests deeper than 64 levels"),
    ('{"dim": 1' + " " * (64 << 20) + "}", r"params\.json has 67,108,874 bytes; at most 67,108,864 are read"),
    (b'{"dim": "\xff"}', r"params\.json is not UTF-8 text"),
])
def test_a_foreign_json_file_is_one_checkpoint_error(tmp_path, content, message):
    from titanctl.checkpoint.formats.base import read_json

    path = tmp_path / "params.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(CheckpointError, match=message):
        read_json(path)


def test_a_config_declaring_more_than_twice_the_stored_values_is_refused():
    from titanctl.checkpoint.trust.model_args import check_declared
    from titanctl.models.common.args import ModelArgs
    from titanctl.models.shapes import weight_shapes

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=512, multiple_of=64)
    stored = list(weight_shapes(args).items())
    check_declared(args, stored, 512, "config.json")  # the model it stores
    check_declared(args, stored[:-3], 512, "config.json")  # a few tensors missing: bind names them later
    wide = args.replace(multiple_of=10**9)  # ffn width 10^9 over the same tensors
    with pytest.raises(CheckpointError, match=r"config\.json declares a model of [\d,]+ parameters \(dim 64, ffn "
                                              r"width 1,000,000,000, 2 layers, vocab 512\), but the checkpoint stores"):
        check_declared(wide, stored, 512, "config.json")


# ----------------------------------------------------------------------------- inspect-trace's folder


def test_a_folder_with_more_files_than_the_limit_is_one_line(tmp_path, monkeypatch):
    from titanctl.observability import trace_analysis

    monkeypatch.setattr(trace_analysis, "MAX_FILES", 5)
    for i in range(6):
        (tmp_path / f"rank{i}.json").write_text(json.dumps({"traceEvents": []}))
    (tmp_path / ".hidden").mkdir()  # hidden folders are not counted
    for i in range(10):
        (tmp_path / ".hidden" / f"{i}.json").write_text("{}")
    with pytest.raises(TraceError, match=r"holds more than 5 files: point inspect-trace at the traces or dumps of one"):
        trace_analysis.inspect_path(tmp_path)
    (tmp_path / "rank5.json").unlink()
    assert trace_analysis.inspect_path(tmp_path).profile is not None

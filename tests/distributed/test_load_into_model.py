"""A Hugging Face or torchtitan checkpoint loads straight into an FSDP2- or TP-sharded model (each rank
cuts its own slice, no communication): every local shard equals what DCP loads from the converted DCP."""

from __future__ import annotations

import json

import pytest

from tests.distributed.harness import WORKERS, torchrun
from tests.unit.trained_model import train_debug_model
from titanctl.checkpoint.convert import convert_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("load_into_model")
    trained = train_debug_model(root / "dcp")
    for fmt in ("hf", "torchtitan"):
        convert_checkpoint(trained["folder"], root / fmt, dst_format=fmt)
    return root


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_sharded_load_from_hf_and_torchtitan_equals_dcp_load(checkpoints, layout, tmp_path):
    folders = [str(checkpoints / "hf"), str(checkpoints / "torchtitan")]
    torchrun(2, [str(WORKERS / "source_load_worker.py")],
             [layout, str(checkpoints / "dcp"), str(tmp_path), *folders])
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(results) == sorted(folders)
        for folder, r in results.items():
            assert r["equal"], (rank, folder, r)
            assert r["loaded"] == r["params"] == 21
            # FSDP shards every parameter; TP every projection and the embedding/output (not the norms).
            assert r["sharded"] == (21 if layout == "fsdp" else 16), (layout, r)

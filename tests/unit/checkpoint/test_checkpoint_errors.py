"""Missing, truncated, corrupt, foreign and mismatched checkpoints, through the `titanctl` binary:
exit code 2, one red line naming the file or tensor and what is wrong, no traceback, and not a
byte changed on disk."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.cli_server import titanctl_run
from tests.conftest import OFFLINE_ENV
from tests.unit.checkpoint.test_checkpoint import TINY, train

ARGS = [*TINY, "--training.steps", "4"]


def tree_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        digest.update(str(path.relative_to(folder)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def own(base: Path, case: Path) -> Path:
    """The case's dump folder holding a copy of the good step-2; returns that step folder."""
    shutil.copytree(base / "checkpoint" / "step-2", case / "checkpoint" / "step-2")
    return case / "checkpoint" / "step-2"


def truncated(base, case):
    data = own(base, case) / "__0_0.distcp"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    return []


def deleted(base, case):
    (own(base, case) / "__0_0.distcp").unlink()
    return []


def corrupt_bytes(base, case):
    data = own(base, case) / "__0_0.distcp"
    data.write_bytes(os.urandom(data.stat().st_size))  # right size, garbage inside
    return []


def random_files(base, case):
    folder = case / "checkpoint" / "step-2"
    folder.mkdir(parents=True)
    for name in ("a.bin", "b.distcp", "weights"):
        (folder / name).write_bytes(os.urandom(4096))
    return []


def torch_save_index(base, case):
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buffer)  # torch.save refuses a path named '.metadata'
    folder = own(base, case)
    (folder / ".metadata").write_bytes(buffer.getvalue())
    meta = json.loads((folder / "titanctl.json").read_text())
    del meta["checksums"]  # as titanctl wrote it before it recorded checksums: the index itself is read
    meta["version"] = 1
    (folder / "titanctl.json").write_text(json.dumps(meta))
    return []


def torch_save_file(base, case):
    case.mkdir()
    torch.save({"tok_embeddings.weight": torch.ones(2)}, case / "model.pt")
    return ["--checkpoint.initial_load_path", str(case / "model.pt")]


def missing_step(base, case):
    own(base, case)
    return ["--checkpoint.load_step", "7"]


def missing_initial(base, case):
    case.mkdir()
    return ["--checkpoint.initial_load_path", str(case / "nowhere")]


def more_layers(base, case):
    own(base, case)
    return ["--model.n_layers", "3"]


def other_dim(base, case):
    """A titanctl checkpoint of a model with dim 128 (the recipe's debug model has 256)."""
    import torch.distributed.checkpoint as dcp

    from titanctl.checkpoint.trust.metadata import write_metadata
    from titanctl.models.common.decoder import Transformer
    from titanctl.models.llama.args import LLAMA3_FLAVORS
    args = LLAMA3_FLAVORS["debugmodel"].replace(dim=128, n_layers=2, vocab_size=4352, max_seq_len=64)
    folder = case / "init"
    dcp.save(Transformer(args).state_dict(), checkpoint_id=str(folder), no_dist=True)
    write_metadata(folder, args, step=0, weights_only=True, dtype="float32")
    return ["--checkpoint.initial_load_path", str(folder)]


CASES = [  # through the CLI: a process each
    (truncated, r"checkpoint/step-2/__0_0\.distcp is truncated: \d+ bytes, but the checkpoint's \.metadata needs \d+"),
    (deleted, r"checkpoint/step-2/__0_0\.distcp is missing"),
    (random_files, r"checkpoint/step-2 is not a titanctl checkpoint: titanctl\.json is missing"),
    (torch_save_file, r"model\.pt is a file, not a checkpoint folder"),
    (missing_step, r"checkpoint\.load_step = 7: .*step-7 does not exist \(complete checkpoints there: step-2\)"),
    (more_layers, r"tensor layers\.2\.attention\.wq\.weight is missing from the checkpoint "
                  r"\(n_layers 2 in the checkpoint's titanctl\.json vs 3 in the recipe\)"),
    (other_dim, r"init: tensor tok_embeddings\.weight has shape \(4352, 128\) in the checkpoint but \(4352, 256\) "
                r"in the model \(dim 128 in the checkpoint's titanctl\.json vs 256 in the recipe\)"),
]
IN_PROCESS = [  # the same Trainer code path, without paying a process start each
    (corrupt_bytes, r"checkpoint/step-2/__0_0\.distcp does not match the sha256 checksum recorded when the "
                    r"checkpoint was saved"),
    (torch_save_index, r"checkpoint/step-2/\.metadata is not a readable DCP index"),
    (missing_initial, r"checkpoint\.initial_load_path .*nowhere does not exist"),
]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("good")
    train(base, "--training.steps", "2")
    return base


@pytest.fixture(scope="module")
def outcomes(good, tmp_path_factory):
    """Every case through the CLI, a few at a time (each is a short-lived process)."""
    base = good
    root = tmp_path_factory.mktemp("cases")
    prepared = []
    for setup, _ in CASES:
        case = root / setup.__name__
        extra = setup(base, case)
        prepared.append((case, extra, tree_hash(case)))

    def run(item):
        case, extra, before = item
        proc = titanctl_run(["train", *ARGS, "--job.dump_folder", str(case), *extra], env={**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": "1"},
                              timeout=300)
        return proc, before, tree_hash(case)

    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(run, prepared))
    return {setup.__name__: result for (setup, _), result in zip(CASES, results)}


@pytest.mark.parametrize("setup, message", CASES, ids=[c[0].__name__ for c in CASES])
def test_bad_checkpoint_is_one_line_exit_2_and_untouched(outcomes, setup, message):
    proc, before, after = outcomes[setup.__name__]
    output = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert len(output) == 1 and output[0].startswith("error: "), output
    assert re.search(message, output[0]), output[0]
    assert "Traceback" not in proc.stderr
    assert before == after, "a failed load changed files on disk"


@pytest.mark.parametrize("setup, message", IN_PROCESS, ids=[c[0].__name__ for c in IN_PROCESS])
def test_bad_checkpoint_in_process(good, tmp_path, setup, message):
    from tests.unit.checkpoint.test_checkpoint import make
    from titanctl.errors import CheckpointError

    case = tmp_path / "case"
    extra = setup(good, case)
    before = tree_hash(case)
    with pytest.raises(CheckpointError) as error:
        make(case, "--training.steps", "4", *extra)
    text = str(error.value)
    assert "\n" not in text and re.search(message, text), text
    assert tree_hash(case) == before

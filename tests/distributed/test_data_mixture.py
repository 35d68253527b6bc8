"""A data mixture with a streaming source, trained under torchrun at DP 2 with checkpoints, then
resumed in one process (DP 1): every later step trains on exactly the sequences the uninterrupted DP-2
run trained on (hashed per sequence by the worker), with losses within the layout tolerance.

The streaming source is a local folder laid out like a Hugging Face dataset repo
(data/train-0000k-of-00002.jsonl), read through `datasets` in streaming mode with HF_DATASETS_OFFLINE=1.
DP 4 and resumes whose ranks share a virtual shard are covered in process (tests/unit/data/test_streaming_loader.py):
two torchruns keep this module near 40 s of work.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.distributed.harness import WORKERS, losses_by_step, rows, sample_log, samples_by_step, torchrun

WORKER = [str(WORKERS / "ckpt_worker.py")]
GLOBAL_BATCH = 8
RUN = [
    "--model.n_layers", "2",
    "--training.seq_len", "32",
    "--training.global_batch_size", str(GLOBAL_BATCH),
    "--training.steps", "4",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--activation_checkpoint.mode", "none",
    "--checkpoint.enable_checkpoint",
    "--checkpoint.interval", "2",
    "--checkpoint.keep_latest_k", "0",
]


def hub_folder(root: Path) -> Path:
    (root / "data").mkdir(parents=True)
    for k in range(2):
        with (root / "data" / f"train-{k:05d}-of-00002.jsonl").open("w") as f:
            for i in range(60):
                words = " ".join(f"f{k}d{i}x{j}" for j in range(4 + (i * 7) % 23))
                f.write(json.dumps({"text": f"File {k} doc {i}: {words}."}) + "\n")
    return root


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[str]]:
    """4 steps at DP 2 (FSDP), checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("mixture")
    folder = hub_folder(root / "repo")
    mixture = [
        "--training.datasets",
        f'[{{name = "bundled", weight = 0.5}}, {{name = "hf:{folder}", weight = 0.5}}]',
    ]
    out = root / "dp2"
    torchrun(2, WORKER, [*RUN, *mixture, "--training.local_batch_size", "4", "--job.dump_folder", str(out)])
    return out, [*RUN, *mixture]


def test_metrics_count_tokens_per_source(reference):
    out, _ = reference
    logged = rows(out)
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    for r in logged:
        by_source = r["tokens_by_source"]
        assert list(by_source)[0] == "bundled" and list(by_source)[1].startswith("hf:")
        assert sum(by_source.values()) == r["step"] * GLOBAL_BATCH * 32
    assert all(n > 0 for n in logged[-1]["tokens_by_source"].values())


def test_resume_at_another_dp_degree_trains_the_same_sequences(reference, tmp_path):
    out, args = reference
    dp = 1
    shutil.copytree(out / "checkpoint" / "step-2", tmp_path / "checkpoint" / "step-2")
    torchrun(dp, WORKER, [*args, "--training.local_batch_size", str(GLOBAL_BATCH // dp),
                          "--job.dump_folder", str(tmp_path)])
    assert {e["consumed_before"] for e in sample_log(tmp_path) if e["step"] == 3} == {2 * GLOBAL_BATCH}
    ref_samples, got_samples = samples_by_step(out), samples_by_step(tmp_path)
    assert got_samples == {3: ref_samples[3], 4: ref_samples[4]}
    assert len(ref_samples[3] | ref_samples[4]) == 2 * GLOBAL_BATCH  # nothing repeated
    ref, got = losses_by_step(out), losses_by_step(tmp_path)
    for step in (3, 4):
        assert abs(got[step] - ref[step]) <= 1e-5 * abs(ref[step]), (dp, step, got[step], ref[step])
    assert rows(tmp_path)[-1]["tokens_by_source"] == rows(out)[-1]["tokens_by_source"]

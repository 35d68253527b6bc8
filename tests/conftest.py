"""Every test runs offline, with its own Hugging Face home and no tiktoken cache."""

import os
import sys
import tempfile
from pathlib import Path

import pytest

_HF_HOME = tempfile.mkdtemp(prefix="titanctl-hf-")
# Token caches and the CPU peak probe are shared by all tests of one session, never the user's.
_CACHE = tempfile.mkdtemp(prefix="titanctl-cache-")
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TIKTOKEN_CACHE_DIR": "",
    "HF_HOME": _HF_HOME,
    "WANDB_MODE": "offline",
    "TITANCTL_CACHE_DIR": _CACHE,
}
os.environ.update(OFFLINE_ENV)

REPO = Path(__file__).resolve().parents[1]
TITANCTL = [sys.executable, "-m", "titanctl"]
# Subprocesses import titanctl from this checkout, whatever the venv's editable install points at.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


# A tiny training run whose checkpoints the checkpoint-trust tests (unit and distributed) copy.
TRUSTED_RUN = [
    "--model.n_layers", "2",
    "--training.seq_len", "64",
    "--training.global_batch_size", "8",
    "--training.local_batch_size", "8",
    "--training.steps", "2",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "1",
    "--metrics.log_freq", "1",
    "--activation_checkpoint.mode", "none",
    "--checkpoint.enable_checkpoint",
    "--checkpoint.interval", "1",
    "--checkpoint.keep_latest_k", "0",
]


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """Dump folder of one 2-step run of a 2-layer model, one process, full checkpoints at steps 1
    and 2 (with checksums). Shared by the session: tests copy it, never change it."""
    from titanctl.config.loader import load_config
    from titanctl.train.trainer import Trainer

    out = tmp_path_factory.mktemp("trusted_run")
    Trainer(load_config(None, [*TRUSTED_RUN, "--job.dump_folder", str(out)])).train()
    return out


@pytest.fixture(scope="session")
def foreign_formats(trained_run, tmp_path_factory) -> dict[str, Path]:
    """The trained run's step-2 weights as a Hugging Face folder (with an index) and as a Meta folder.
    Shared by the session: tests copy them, never change them."""
    from titanctl.checkpoint.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("foreign")
    for fmt in ("hf", "meta"):
        convert_checkpoint(trained_run / "checkpoint" / "step-2", root / fmt, dst_format=fmt)
    return {"hf": root / "hf", "meta": root / "meta"}

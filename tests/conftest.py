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

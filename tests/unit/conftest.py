"""Fixtures shared by the unit tests of a session."""

import pytest

from tests.unit.trained_model import train_debug_model
from titanctl.data.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def trained_debug(tmp_path_factory):
    """The debug model trained for a few steps, as a titanctl DCP folder (trained once per session)."""
    return train_debug_model(tmp_path_factory.mktemp("trained") / "dcp")


@pytest.fixture
def offline_data(monkeypatch, tmp_path):
    """Hub access off, and every cache (datasets, tiktoken, titanctl's tokens) in this test's folder."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    monkeypatch.setenv("TITANCTL_CACHE_DIR", str(tmp_path / "titanctl_cache"))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """The bundled tokenizer."""
    return Tokenizer()

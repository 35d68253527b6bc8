"""Fixtures shared by the unit tests of a session."""

import pytest

from tests.unit.trained_model import train_debug_model


@pytest.fixture(scope="session")
def trained_debug(tmp_path_factory):
    """The debug model trained for a few steps, as a titanctl DCP folder (trained once per session)."""
    return train_debug_model(tmp_path_factory.mktemp("trained") / "dcp")

"""Fixtures shared by the distributed tests of a session."""

import pytest

from tests.distributed.worlds import Worlds, selected_cases


@pytest.fixture(scope="session")
def worlds(request, tmp_path_factory) -> Worlds:
    """The torchrun worlds that run every registered layout case (one launch per process count)."""
    return Worlds(tmp_path_factory.mktemp("worlds"), selected_cases(request.session.items))

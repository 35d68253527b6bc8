"""Fixtures shared by the distributed tests of a session."""

import pytest

from tests.distributed.worlds import Worlds, selected_cases

_WORLDS: list[Worlds] = []


def pytest_collection_finish(session):
    """Start the session's torchrun worlds now, in the background (tests/distributed/worlds.py)."""
    selected = selected_cases(session.items)
    if selected and not session.config.option.collectonly:
        _WORLDS.append(Worlds(session.config._tmp_path_factory.mktemp("worlds"), selected))
        _WORLDS[0].start()


@pytest.fixture(scope="session")
def worlds(request, tmp_path_factory) -> Worlds:
    """The torchrun worlds that run every registered layout case (one launch per process count)."""
    if not _WORLDS:
        _WORLDS.append(Worlds(tmp_path_factory.mktemp("worlds"), selected_cases(request.session.items)))
    return _WORLDS[0]

"""Fixtures shared by the distributed tests of a session."""

import os

import pytest

from tests.distributed.worlds import Worlds, selected_cases

_WORLDS: list[Worlds] = []


def pytest_collection_finish(session):
    """Start the session's torchrun worlds now, in the background (tests/distributed/worlds.py)."""
    selected = selected_cases(session.items)
    if selected and not session.config.option.collectonly:
        _WORLDS.append(Worlds(_root(session.config._tmp_path_factory), selected, runs_worlds=_runs_worlds()))
        _WORLDS[0].start()


def pytest_sessionfinish(session):
    """Under xdist the other worker may still read the worlds this one runs: it ends after them."""
    if _WORLDS and "PYTEST_XDIST_WORKER" in os.environ:
        _WORLDS[0].join()


def _runs_worlds() -> bool:
    """Without xdist this process; under xdist its first worker (every worker collects the same cases)."""
    return os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0"


def _root(tmp_path_factory):
    """Under xdist a folder every worker of the session shares: the parent of the workers' own."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return tmp_path_factory.mktemp("worlds")
    root = tmp_path_factory.getbasetemp().parent / "worlds"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session")
def worlds(request, tmp_path_factory) -> Worlds:
    """The torchrun worlds that run every registered layout case (one launch per process count)."""
    if not _WORLDS:
        _WORLDS.append(Worlds(_root(tmp_path_factory), selected_cases(request.session.items),
                              runs_worlds=_runs_worlds()))
    return _WORLDS[0]

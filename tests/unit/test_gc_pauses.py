"""titanctl.gc_pauses.heavy_imports: no automatic collection inside, the collector as it was after, and
everything alive at the end frozen (so that later collections skip it)."""

import gc

import pytest

from titanctl.gc_pauses import heavy_imports


def test_no_collection_inside_and_the_survivors_frozen_after():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with heavy_imports():
        assert not gc.isenabled()
        made = [[] for _ in range(1000)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(made)


def test_a_collector_turned_off_before_stays_off_and_an_error_restores_it():
    gc.disable()
    try:
        with heavy_imports():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ImportError), heavy_imports():
        raise ImportError("no module named nowhere")
    assert gc.isenabled()

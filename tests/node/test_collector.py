"""The node process's garbage-collector policy (``iop-node`` sets it; the library does not)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from iop_node.__main__ import YOUNG_THRESHOLD, tune_collector


@pytest.fixture
def restored_collector() -> Iterator[None]:
    saved = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*saved)


@pytest.mark.usefixtures("restored_collector")
def test_the_young_threshold_rises_and_the_startup_objects_are_frozen() -> None:
    _, middle, oldest = gc.get_threshold()
    kept = [object(), {}]  # tracked objects alive at startup
    tune_collector()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, middle, oldest)
    assert gc.get_freeze_count() > len(kept)

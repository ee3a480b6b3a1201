"""The Edge process's garbage-collector policy: a larger young generation, set by the entry point only."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from iop_edge import __main__ as entry
from iop_edge import _collector


@pytest.fixture
def collector_threshold() -> Iterator[None]:
    """Restore the process's collector thresholds after the test."""
    threshold = gc.get_threshold()
    yield
    gc.set_threshold(*threshold)


@pytest.mark.usefixtures("collector_threshold")
def test_tune_raises_only_the_young_threshold() -> None:
    gc.set_threshold(700, 10, 10)
    _collector.tune()
    assert gc.get_threshold() == (_collector.YOUNG_THRESHOLD, 10, 10)


@pytest.mark.usefixtures("collector_threshold")
def test_the_entry_point_tunes_before_it_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """iop-edge's main() sets the policy before the Edge starts (a missing file: exit 2 right after)."""
    gc.set_threshold(700, 10, 10)
    with pytest.raises(SystemExit) as exit_info:
        entry.main(["--config", f"{tmp_path}/missing.yaml"])
    assert exit_info.value.code == entry.EXIT_CONFIG
    assert gc.get_threshold()[0] == _collector.YOUNG_THRESHOLD

"""Fixtures of the fuzz suite: one Edge thread for the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fuzz.harness import EdgeThread


@pytest.fixture(scope="session")
def edge_thread(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeThread]:
    """The Edge every Edge-side fuzz example talks to (started once, stopped at the end)."""
    edge = EdgeThread(tmp_path_factory.mktemp("fuzz") / "edge.yaml")
    edge.start()
    try:
        yield edge
    finally:
        edge.stop()

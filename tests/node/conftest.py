"""Fixtures for the Node tests (the harness itself is ``node.harness``)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iop_mock import MockBackend, serve_mock_backend
from node.harness import Backend, FakeEdge


@pytest.fixture
async def backend(nursery: trio.Nursery) -> Backend:
    """The mock HTTP backend on 127.0.0.1 port 0: slow enough that runs stay in flight."""
    mock = MockBackend(latency=0.0, tokens_per_second=0.0)
    port = await nursery.start(serve_mock_backend, mock)
    return Backend(mock, port)


@pytest.fixture
async def edge(nursery: trio.Nursery) -> FakeEdge:
    fake = FakeEdge()
    await nursery.start(fake.serve)
    return fake


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)

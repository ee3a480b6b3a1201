"""[upstream-bounds] Identifiers a node sends before it is authenticated are bounded and logged escaped.

A ``register`` whose ``node_id`` is longer than 128 characters or holds a
character that is not printable (a newline, say) is ``unknown_node`` at once,
and every node id and provider id a node sends reaches the log escaped: a
newline in one can never forge a log line. In-memory streams, MockClock.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio
import trio.testing

from edge.harness import TOKEN_A
from edge.test_node_limits import _memory_connection, _open_ws, _service
from iop_edge import EdgeService
from iop_edge.nodes.registry import MAX_NODE_ID_CHARS
from iop_wire import PROTOCOL_VERSION, ProviderInfo, Register, Registered, Rejected, decode, encode

FORGED = "INFO iop_edge: node node-a registered"


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


async def register(
    nursery: trio.Nursery, service: EdgeService, node_id: str, provider: str = "gpu0"
) -> Registered | Rejected:
    """Register ``node_id`` (with node-a's token) on a fresh connection; the Edge's answer."""
    async with _memory_connection(service, nursery) as client:
        ws = await _open_ws(nursery, client)
        await ws.send_message(
            encode(Register(node_id, TOKEN_A, PROTOCOL_VERSION, (ProviderInfo(provider, "mock", 1),)))
        )
        answer = decode(await ws.get_message())
        await ws.aclose()
        assert isinstance(answer, Registered | Rejected)
        return answer


@pytest.mark.req("upstream-bounds")
async def test_a_node_id_too_long_or_not_printable_is_unknown_and_logged_escaped(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    service = _service(tmp_path)
    async with trio.open_nursery() as nursery:
        for node_id in (f"node-a\n{FORGED}", "node-a\u2028x", "n" * (MAX_NODE_ID_CHARS + 1), "x" * 60_000):
            answer = await register(nursery, service, node_id)
            assert isinstance(answer, Rejected) and answer.code == "unknown_node"
        answer = await register(nursery, service, "node-a", provider=f"gpu0\n{FORGED}")
        assert isinstance(answer, Registered)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    lines = caplog.text.splitlines()
    assert not any(line.startswith(FORGED) for line in lines)
    assert all(len(line) < 1000 for line in lines)
    assert "'node-a\\nINFO iop_edge" in caplog.text and "'gpu0\\nINFO iop_edge" in caplog.text
    assert service.registry.limits.pending == 0

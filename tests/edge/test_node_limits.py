"""[node-socket-limits] The pure core of the node socket's limits, and its timing on a MockClock.

The first half drives :class:`iop_edge.nodes.limits.PendingLimits` directly
(no I/O, time passed in). The second half serves connections made of
in-memory streams with :meth:`NodeRegistry.serve_stream` under
``MockClock(autojump_threshold=0)``, so deadlines and backoff delays are
asserted as exact virtual durations.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio.testing
from trio_websocket import ConnectionClosed, WebSocketConnection, wrap_client_stream

from edge.harness import TOKEN_A, EdgeLayout
from iop_edge import EdgeService
from iop_edge.config import load_edge_config
from iop_edge.nodes.limits import PendingLimits, Source, source_of
from iop_wire import PROTOCOL_VERSION, ProviderInfo, Register, Registered, Rejected, decode, encode

pytestmark = pytest.mark.req("node-socket-limits")

A = Source("192.0.2.1", "public")
B = Source("192.0.2.2", "public")

# ---------------------------------------------------------------------------- pure core


def test_pending_caps_per_source_and_overall() -> None:
    """[node-socket-limits] at most max_pending_per_source from one source, max_pending overall;
    a refusal counts nothing; release makes room again."""
    limits = PendingLimits(max_pending=3, max_pending_per_source=2)
    assert [limits.open(A), limits.open(A), limits.open(A)] == [None, None, "max_pending_per_source"]
    assert limits.open(B) is None
    assert limits.open(B) == "max_pending"
    assert (limits.pending, limits.pending_from(A), limits.pending_from(B)) == (3, 2, 1)
    limits.release(A)
    assert limits.open(B) is None
    assert limits.open(A) == "max_pending"
    for source in (A, B, B):
        limits.release(source)
    assert limits.statistics().pending == 0 and limits.statistics().sources_pending == 0
    with pytest.raises(RuntimeError, match="release without open"):
        limits.release(A)


def test_lowering_a_cap_refuses_new_connections_only() -> None:
    """[node-socket-limits] a reload that lowers a cap keeps every pending connection and counts them."""
    limits = PendingLimits(max_pending=4, max_pending_per_source=4)
    for _ in range(3):
        assert limits.open(A) is None
    limits.set_policy(max_pending=2, max_pending_per_source=1, backoff_base=0.1, backoff_max=1.0)
    assert limits.open(B) == "max_pending"
    assert limits.pending == 3
    for _ in range(3):
        limits.release(A)
    assert limits.open(B) is None
    with pytest.raises(ValueError, match="must be >= 1"):
        limits.set_policy(max_pending=0, max_pending_per_source=1, backoff_base=0.1, backoff_max=1.0)
    with pytest.raises(ValueError, match="backoff_base <= backoff_max"):
        limits.set_policy(max_pending=1, max_pending_per_source=1, backoff_base=2.0, backoff_max=1.0)


def test_failure_backoff_grows_to_its_bound_and_is_forgotten() -> None:
    """[node-socket-limits] each failure of a source waits longer than the one before, up to
    backoff_max; other sources are not affected; a quiet source starts again from the base."""
    limits = PendingLimits(max_pending=8, max_pending_per_source=8, backoff_base=0.1, backoff_max=1.0)
    delays = [limits.failed(A, now=float(i)) for i in range(6)]
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert limits.failed(B, now=6.0) == 0.1
    assert limits.failures(A, now=6.0) == 6
    # backoff_forget defaults to 4 * backoff_max: 4 s after the last failure it is forgotten
    assert limits.failures(A, now=5.0 + 4.0) == 0
    assert limits.failed(A, now=5.0 + 4.0) == 0.1


def test_failure_table_is_bounded() -> None:
    """[node-socket-limits] a flood of failures from many sources keeps at most max_tracked_sources records,
    dropping the least recently failed first."""
    limits = PendingLimits(max_pending=8, max_pending_per_source=8, max_tracked_sources=3)
    sources = [Source(f"198.51.100.{i}", "public") for i in range(10)]
    for i, source in enumerate(sources):
        limits.failed(source, now=i * 0.01)
    assert limits.statistics().sources_tracked == 3
    assert [limits.failures(s, now=0.1) for s in sources[-3:]] == [1, 1, 1]
    assert limits.failures(sources[0], now=0.1) == 0


@pytest.mark.parametrize(
    ("host", "key", "address_class"),
    [
        ("127.0.0.1", "127.0.0.1", "loopback"),
        ("10.1.2.3", "10.1.2.3", "private"),
        ("192.168.0.9", "192.168.0.9", "private"),
        ("8.8.8.8", "8.8.8.8", "public"),
        ("::1", "::/64", "loopback"),
        ("2001:4860:1:2:3:4:5:6", "2001:4860:1:2::/64", "public"),
        ("2001:4860:1:2:ffff::1", "2001:4860:1:2::/64", "public"),
        ("fe80::1%eth0", "fe80::/64", "private"),
        ("::ffff:8.8.4.4", "8.8.4.4", "public"),
        (None, "unknown", "unknown"),
        ("not-an-address", "unknown", "unknown"),
    ],
)
def test_source_of(host: str | None, key: str, address_class: str) -> None:
    """[node-socket-limits] per-source limits count an IPv4 address or an IPv6 /64; the metrics label
    is only the address class."""
    source = source_of(host)
    assert (source.key, source.address_class) == (key, address_class)


# ---------------------------------------------------------------------------- registry on a MockClock


def _service(tmp_path: Path, **knobs: int) -> EdgeService:
    layout = EdgeLayout(
        extra=tuple(f"{key}: {value}" for key, value in knobs.items()),
    )
    path = tmp_path / "edge.yaml"
    path.write_text(layout.yaml())
    return EdgeService(load_edge_config(path), config_path=path)


@asynccontextmanager
async def _memory_connection(
    service: EdgeService, nursery: trio.Nursery
) -> AsyncIterator[trio.abc.HalfCloseableStream]:
    """A connection to the registry over in-memory streams; yields the client's end."""
    client, server = trio.testing.memory_stream_pair()
    nursery.start_soon(service.registry.serve_stream, server)
    try:
        yield client
    finally:
        await trio.aclose_forcefully(client)


async def _open_ws(nursery: trio.Nursery, client: trio.abc.Stream) -> WebSocketConnection:
    return await wrap_client_stream(nursery, client, "edge", "/")


async def _register(ws: WebSocketConnection, token: str, node_id: str = "node-a") -> Registered | Rejected:
    await ws.send_message(encode(Register(node_id, token, PROTOCOL_VERSION, (ProviderInfo("gpu0", "mock", 1),))))
    answer = decode(await ws.get_message())
    assert isinstance(answer, Registered | Rejected)
    return answer


def _metric(service: EdgeService, name: str, **labels: str) -> float:
    value = service.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_idle_connection_closed_at_the_deadline(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """[node-socket-limits] a connection that sends nothing is closed exactly at
    node_handshake_timeout_ms; one that finished the WebSocket handshake but sends no register is
    closed at the same deadline (1008 register timeout); the pending count is 0 afterwards."""
    service = _service(tmp_path, node_handshake_timeout_ms=2500)
    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        async with _memory_connection(service, nursery) as idle:
            await trio.testing.wait_all_tasks_blocked()
            assert service.registry.limits.pending == 1
            assert await idle.receive_some() == b""
            assert trio.current_time() - start == pytest.approx(2.5)
        assert service.registry.limits.pending == 0
        start = trio.current_time()
        async with _memory_connection(service, nursery) as silent:
            ws = await _open_ws(nursery, silent)
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
            assert trio.current_time() - start == pytest.approx(2.5)
            assert closed.value.reason.code == 1008
            assert closed.value.reason.reason == "register timeout"
        await trio.testing.wait_all_tasks_blocked()
        assert service.registry.limits.pending == 0
        assert _metric(service, "iop_node_pending_closed_total", reason="handshake_timeout") == 2


async def test_peer_that_leaves_before_the_handshake_frees_its_place_at_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """[node-socket-limits] a peer closing before the WebSocket handshake is not held until the deadline."""
    service = _service(tmp_path, node_handshake_timeout_ms=60_000)
    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        async with _memory_connection(service, nursery) as client:
            await client.send_all(b"GET / HT")
            await trio.testing.wait_all_tasks_blocked()
            assert service.registry.limits.pending == 1
        await trio.testing.wait_all_tasks_blocked()
        assert service.registry.limits.pending == 0
        assert trio.current_time() == start
        assert _metric(service, "iop_node_pending_closed_total", reason="handshake_timeout") == 0


async def test_bad_tokens_are_answered_later_each_time(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """[node-socket-limits] bad_token / unknown_node from one source: answered after 0.1, 0.2, 0.4,
    0.8, 0.8 s (base 100 ms, bound 800 ms); counted by reason and address class; the token is never
    logged; a good token is answered at once and its registration is not delayed."""
    caplog.set_level(logging.DEBUG)
    service = _service(tmp_path, node_reject_backoff_base_ms=100, node_reject_backoff_max_ms=800)
    wrong = "wrong-token-3f9a-sentinel"
    waits = []
    async with trio.open_nursery() as nursery:
        for node_id in ("node-a", "node-a", "node-x", "node-a", "node-a"):
            async with _memory_connection(service, nursery) as client:
                ws = await _open_ws(nursery, client)
                start = trio.current_time()
                answer = await _register(ws, wrong, node_id)
                waits.append(trio.current_time() - start)
                assert isinstance(answer, Rejected)
                assert answer.code == ("unknown_node" if node_id == "node-x" else "bad_token")
        assert waits == pytest.approx([0.1, 0.2, 0.4, 0.8, 0.8])
        async with _memory_connection(service, nursery) as client:
            ws = await _open_ws(nursery, client)
            start = trio.current_time()
            assert isinstance(await _register(ws, TOKEN_A), Registered)
            assert trio.current_time() == start
            assert service.registry.limits.pending == 0  # registered: no longer pending
            await ws.aclose()
        await trio.testing.wait_all_tasks_blocked()
    assert _metric(service, "iop_node_registration_failures_total", reason="bad_token", address_class="unknown") == 4
    assert _metric(service, "iop_node_registration_failures_total", reason="unknown_node", address_class="unknown") == 1
    assert wrong not in caplog.text and TOKEN_A not in caplog.text
    assert "rejected node registration node-a from unknown: invalid token (bad_token)" in caplog.text
    assert service.registry.limits.pending == 0


async def test_registered_nodes_never_count_and_are_never_cut(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """[node-socket-limits] with the pending cap full, a registered node keeps its connection and
    keeps working; new connections beyond the cap are closed at once (virtual time 0)."""
    service = _service(tmp_path, node_max_pending=2, node_max_pending_per_address=2, node_handshake_timeout_ms=9000)
    async with trio.open_nursery() as nursery:
        async with _memory_connection(service, nursery) as node:
            ws = await _open_ws(nursery, node)
            assert isinstance(await _register(ws, TOKEN_A), Registered)
            async with _memory_connection(service, nursery), _memory_connection(service, nursery):
                await trio.testing.wait_all_tasks_blocked()
                assert service.registry.limits.pending == 2
                start = trio.current_time()
                async with _memory_connection(service, nursery) as refused:
                    assert await refused.receive_some() == b""
                    assert trio.current_time() == start
                assert _metric(service, "iop_node_pending_closed_total", reason="max_pending") == 1
                # the idle two are closed at the deadline; the registered node is untouched
                await trio.sleep(10)
                assert service.registry.limits.pending == 0
            assert service.admission.is_connected("node-a")
            assert not ws.closed
            await ws.aclose()
        await trio.testing.wait_all_tasks_blocked()
    assert not service.admission.is_connected("node-a")

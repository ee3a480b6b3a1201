"""[node-socket-limits] Floods of the Edge's node socket over real loopback sockets.

The flooders connect from other loopback addresses (127.0.0.2, 127.0.0.3, ...:
Linux routes all of 127.0.0.0/8 to ``lo``) so that a real node connecting from
127.0.0.1 is a different source, as an attacker and a node would be. Limits
and deadlines are configured small so each test runs in well under a second;
exact timings are proven on a MockClock in ``test_node_limits.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing
from trio_websocket import ConnectionClosed, HandshakeError, wrap_client_stream

from edge.harness import Edge, EdgeLayout, eventually, mock_provider, node_config, real_node, running_edge
from iop_edge.nodes.limits import source_of
from iop_edge.nodes.peer_watch import PeerWatch
from iop_wire import PROTOCOL_VERSION, ProviderInfo, Register, Rejected, decode, encode

pytestmark = pytest.mark.req("node-socket-limits")


def _layout(**knobs: int) -> EdgeLayout:
    return EdgeLayout(extra=tuple(f"{key}: {value}" for key, value in knobs.items()))


def _metric(edge: Edge, name: str, **labels: str) -> float:
    value = edge.service.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def _closed_by_edge(edge: Edge, reason: str) -> int:
    return int(_metric(edge, "iop_node_pending_closed_total", reason=reason))


def _pending_from(edge: Edge, host: str) -> int:
    return edge.service.registry.limits.pending_from(source_of(host))


async def _idle(edge: Edge, source: str) -> trio.SocketStream:
    """A TCP connection to the node socket from ``source`` that never sends a byte."""
    return await trio.open_tcp_stream("127.0.0.1", edge.node_port, local_address=source)


async def _wait_closed(stream: trio.SocketStream) -> None:
    """Read until the Edge has closed the connection (EOF or reset)."""
    try:
        while await stream.receive_some(4096):
            pass
    except trio.BrokenResourceError:
        pass
    await stream.aclose()


async def test_pending_caps_hold_and_refused_connections_close_at_once(tmp_path: Path) -> None:
    """[node-socket-limits] 24 idle connections from three addresses, caps 3 per address and 6 overall:
    exactly 6 stay pending, the 18 others are closed at once (5 for their address's cap, then 13 for
    the overall cap, which is checked first); a real node cannot get in while the overall cap is full, and registers as soon as
    pending connections go away; every pending count is 0 at the end."""
    layout = _layout(node_max_pending=6, node_max_pending_per_address=3, node_handshake_timeout_ms=60_000)
    with trio.fail_after(20):
        async with running_edge(tmp_path, layout) as edge:
            held: list[trio.SocketStream] = []
            refused: list[trio.SocketStream] = []
            limits = edge.service.registry.limits

            def accounted() -> int:
                refusals = _closed_by_edge(edge, "max_pending") + _closed_by_edge(edge, "max_pending_per_source")
                return limits.pending + refusals

            for source in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):
                for _ in range(8):
                    before = limits.pending
                    stream = await _idle(edge, source)
                    await eventually(lambda: accounted() == len(held) + len(refused) + 1)
                    (held if limits.pending > before else refused).append(stream)
            assert len(held) == 6 and len(refused) == 18
            assert [_pending_from(edge, f"127.0.0.{i}") for i in (2, 3, 4)] == [3, 3, 0]
            assert _closed_by_edge(edge, "max_pending_per_source") == 5
            assert _closed_by_edge(edge, "max_pending") == 13
            for stream in refused:
                await _wait_closed(stream)
            assert edge.service.registry.limits.pending == 6
            metrics = (await edge.http.get("/metrics")).text
            assert "iop_node_pending_connections 6.0" in metrics
            # the flooders give up three connections: room for the node
            for stream in held[:3]:
                await stream.aclose()
            await eventually(lambda: edge.service.registry.limits.pending == 3)
            async with real_node(edge, node_config(edge, "node-a", [mock_provider()])):
                assert edge.service.registry.limits.pending == 3  # registered: not pending
                response = await edge.chat("ornith-fast")
                assert response.status_code == 200
            for stream in held[3:]:
                await stream.aclose()
            await eventually(lambda: edge.service.registry.limits.pending == 0)
            assert edge.service.registry.limits.statistics().sources_pending == 0


async def test_real_node_registers_during_an_idle_flood_and_idle_ones_close_at_the_deadline(tmp_path: Path) -> None:
    """[node-socket-limits] a flood of idle connections from 127.0.0.2 (up to 300, until the node is in)
    keeps its address's cap full; a real node from 127.0.0.1 registers meanwhile; every flood
    connection is closed by the Edge: at once beyond the cap, at the 200 ms deadline otherwise;
    counters drain to 0."""
    layout = _layout(node_max_pending=16, node_max_pending_per_address=4, node_handshake_timeout_ms=200)
    with trio.fail_after(30):
        async with running_edge(tmp_path, layout) as edge:
            flood: list[trio.SocketStream] = []
            registered = trio.Event()

            async def flooder() -> None:
                while len(flood) < 300 and not registered.is_set():
                    flood.append(await _idle(edge, "127.0.0.2"))
                    await trio.sleep(0.01)  # longer than the harness's 2 ms settle cushion

            async with trio.open_nursery() as nursery:
                nursery.start_soon(flooder)
                await eventually(lambda: _pending_from(edge, "127.0.0.2") == 4)
                async with real_node(edge, node_config(edge, "node-a", [mock_provider()])):
                    registered.set()
                    assert (await edge.chat("ornith-fast")).status_code == 200
            assert len(flood) < 300  # the node got in while the flood was still going
            async with trio.open_nursery() as nursery:
                for stream in flood:
                    nursery.start_soon(_wait_closed, stream)
            timeouts = _closed_by_edge(edge, "handshake_timeout")
            refused = _closed_by_edge(edge, "max_pending_per_source")
            assert timeouts >= 4 and timeouts + refused == len(flood)
            assert _closed_by_edge(edge, "max_pending") == 0
            await eventually(lambda: edge.service.registry.limits.pending == 0)


async def _bad_token_attempt(edge: Edge, source: str, answers: list[str]) -> None:
    """Connect from ``source``, register with a wrong token, note the answer (or that it was refused).

    trio-websocket's client waits for a handshake answer even once the server
    has closed the socket, so the attempt also watches for the end of the stream.
    """
    stream = await trio.open_tcp_stream("127.0.0.1", edge.node_port, local_address=source)
    watched = PeerWatch(stream)
    register = Register("node-a", "wrong", PROTOCOL_VERSION, (ProviderInfo("gpu0", "mock", 1),))

    async def attempt() -> None:
        try:
            ws = await wrap_client_stream(nursery, watched, "127.0.0.1", "/")
            await ws.send_message(encode(register))
            answer = decode(await ws.get_message())
            assert isinstance(answer, Rejected)
            answers.append(answer.code)
        except (HandshakeError, ConnectionClosed, trio.BrokenResourceError):
            answers.append("refused")
        nursery.cancel_scope.cancel()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(attempt)
            await watched.ended.wait()
            await trio.testing.wait_all_tasks_blocked()  # let a rejection already read be noted
            if not nursery.cancel_scope.cancel_called:
                answers.append("refused")
            nursery.cancel_scope.cancel()
    finally:
        await stream.aclose()


async def test_real_node_registers_during_a_bad_token_flood(tmp_path: Path) -> None:
    """[node-socket-limits] bad-token registrations from 127.0.0.3, a new one every 10 ms (up to 300,
    until the node is in): those admitted (8 may be pending) are answered bad_token after a growing
    delay, the others are refused at once; a real node from 127.0.0.1 registers meanwhile; failures
    are counted by reason and address class; counters drain to 0."""
    layout = _layout(node_reject_backoff_base_ms=10, node_reject_backoff_max_ms=80, node_handshake_timeout_ms=5000)
    answers: list[str] = []
    started = 0
    registered = trio.Event()

    def failures(edge: Edge) -> int:
        return int(_metric(edge, "iop_node_registration_failures_total", reason="bad_token", address_class="loopback"))

    with trio.fail_after(30):
        async with running_edge(tmp_path, layout) as edge:
            async with trio.open_nursery() as attempts:

                async def flooder() -> None:
                    nonlocal started
                    while started < 300 and not registered.is_set():
                        attempts.start_soon(_bad_token_attempt, edge, "127.0.0.3", answers)
                        started += 1
                        await trio.sleep(0.01)  # longer than the harness's 2 ms settle cushion

                attempts.start_soon(flooder)
                await eventually(lambda: failures(edge) >= 8)
                async with real_node(edge, node_config(edge, "node-a", [mock_provider()])):
                    registered.set()
                    assert (await edge.chat("ornith-fast")).status_code == 200
            assert started < 300  # the node got in while the flood was still going
            assert len(answers) == started
            rejected = answers.count("bad_token")
            assert rejected >= 8 and rejected + answers.count("refused") == started
            assert failures(edge) == rejected
            assert _closed_by_edge(edge, "max_pending_per_source") == answers.count("refused")
            await eventually(lambda: edge.service.registry.limits.pending == 0)

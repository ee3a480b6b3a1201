"""An aborted request's connection held until its backend lets go (:mod:`iop_node.upstream.abort`).

The pool's side of [cancel-upstream], on real loopback sockets: a request cancelled within a
run (:data:`LETTING_GO` set) keeps its connection and pool slot until the backend closes it, or
until the grace passes; a failure, or a request outside a run, is closed at once.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from iop_node.upstream.abort import LETTING_GO, Abandoned
from iop_node.upstream.http11 import PostRequests
from iop_node.upstream.pool import H11Transport
from node.test_transport import ScriptedServer

pytestmark = pytest.mark.req("cancel-upstream")

TIMEOUTS = {"connect": 5.0, "read": 30.0, "write": 5.0, "pool": 5.0}


async def _cancelled_post(transport: H11Transport, port: int, started: trio.Event) -> bool:
    """Post within a run and cancel it once the server has the request; whether it was cancelled."""
    requests = PostRequests(httpx.URL(f"http://127.0.0.1:{port}/v1/chat/completions"), b"application/json")
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:

            async def post() -> None:
                await transport.post(requests, b"{}", TIMEOUTS)

            nursery.start_soon(post)
            await started.wait()
            scope.cancel()
    return scope.cancelled_caught


async def _cancelled_in_a_run(transport: H11Transport, port: int, started: trio.Event) -> Abandoned:
    """:func:`_cancelled_post` within a run's context; the run's :class:`Abandoned`."""
    abandoned = Abandoned()
    token = LETTING_GO.set(abandoned)
    try:
        assert await _cancelled_post(transport, port, started)
    finally:
        LETTING_GO.reset(token)
    return abandoned


async def _hanging_server(nursery: trio.Nursery) -> tuple[int, trio.Event]:
    """A server that holds every request until the client's end, then closes; its port, and an event
    set once it has a request."""
    got = trio.Event()

    def script(connection: int, request: int) -> str:
        got.set()
        return "hang"

    return await nursery.start(ScriptedServer(script).serve), got


async def test_a_cancelled_request_is_held_until_the_backend_lets_go(nursery: trio.Nursery) -> None:
    """[cancel-upstream] the backend reads the request's end and closes: the slot returns only then."""
    port, got = await _hanging_server(nursery)
    transport = H11Transport(1, abort_grace=30.0)
    abandoned = await _cancelled_in_a_run(transport, port, got)
    assert transport.open_connections == 1  # held: the backend has not let go yet
    await abandoned.settle()
    assert (transport.open_connections, transport.let_go_late) == (0, 0)
    assert transport.waiting == 0
    await transport.aclose()


async def _keeping_server(nursery: trio.Nursery) -> tuple[int, trio.Event]:
    """A server that reads a request and then keeps the connection open, never answering nor closing."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    got = trio.Event()

    async def keep(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)  # the request; then nothing, the connection kept open
        got.set()
        await trio.sleep_forever()

    nursery.start_soon(trio.serve_listeners, keep, listeners)
    return listeners[0].socket.getsockname()[1], got


async def test_a_backend_that_does_not_let_go_is_let_go_of_after_the_grace(nursery: trio.Nursery) -> None:
    """[cancel-upstream] a backend that keeps the connection open: closed once the grace ran out, counted."""
    port, got = await _keeping_server(nursery)
    transport = H11Transport(1, abort_grace=0.05)
    abandoned = await _cancelled_in_a_run(transport, port, got)
    await abandoned.settle()
    assert (transport.open_connections, transport.let_go_late) == (0, 1)
    await transport.aclose()


async def test_a_run_cut_as_stalled_lets_go_at_once(nursery: trio.Nursery) -> None:
    """A run the stall watchdog cut is a failure (it fails over now): its held connection closes at once."""
    port, got = await _keeping_server(nursery)
    transport = H11Transport(1, abort_grace=30.0)
    abandoned = await _cancelled_in_a_run(transport, port, got)
    assert transport.open_connections == 1
    abandoned.let_go_now()
    assert (transport.open_connections, transport.let_go_late, transport.waiting) == (0, 0, 0)
    await abandoned.settle()  # nothing left to wait for
    await transport.aclose()


async def test_outside_a_run_a_cancelled_request_is_closed_at_once(nursery: trio.Nursery) -> None:
    """No run's context (a warm-up, a test's client): the connection closes at once, as before."""
    port, got = await _hanging_server(nursery)
    transport = H11Transport(1, abort_grace=30.0)
    assert await _cancelled_post(transport, port, got)
    assert transport.open_connections == 0
    await transport.aclose()


async def test_a_failed_request_is_closed_at_once(nursery: trio.Nursery) -> None:
    """A read timeout within a run is a failure, not an abort: closed at once, nothing held."""
    server = ScriptedServer(lambda connection, request: "hang")
    port = await nursery.start(server.serve)
    transport = H11Transport(1, abort_grace=30.0)
    requests = PostRequests(httpx.URL(f"http://127.0.0.1:{port}/v1/chat/completions"), b"application/json")
    abandoned = Abandoned()
    token = LETTING_GO.set(abandoned)
    try:
        with pytest.raises(httpx.ReadTimeout):
            await transport.post(requests, b"{}", {**TIMEOUTS, "read": 0.05})
    finally:
        LETTING_GO.reset(token)
    assert transport.open_connections == 0
    await transport.aclose()

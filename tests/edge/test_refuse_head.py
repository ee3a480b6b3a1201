"""Refusals on the request head and pacing in the Edge's listener: a refused request never reaches
the app, goes out as bytes encoded once, keeps the connection in step (pipelined requests, a body
still to come, ``connection: close``); paused connections are woken by one timer, in time order.

The pacer is tested alone on trio's ``MockClock``; the listener on real sockets (127.0.0.1, port 0,
bounded by ``trio.fail_after``).
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from edge.harness import eventually
from edge.test_http_server import _read_response
from iop_edge.listener.pacing import PACING_BATCH, PACING_QUANTUM, Pacer
from iop_edge.listener.server import CannedResponse, ConnectionCounter, HttpLimits, serve_http

FULL = CannedResponse(
    429, [(b"content-type", b"text/plain"), (b"retry-after", b"1"), (b"content-length", b"4")], b"full"
)


def test_a_canned_response_is_what_h11_would_send() -> None:
    """The bytes sent as they are equal h11's own encoding; after ``connection: close``, h11 says so."""
    assert FULL.keep_alive.startswith(b"HTTP/1.1 429 \r\n") and FULL.keep_alive.endswith(b"\r\n\r\nfull")
    assert b"connection: close" not in FULL.keep_alive.lower()
    assert b"connection: close" in FULL.closing.lower() and FULL.closing.endswith(b"full")


async def test_paused_connections_wake_in_time_order_from_one_timer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Each pause wakes at its time (an earlier one booked later moves the timer up); pauses due
    within ``PACING_QUANTUM`` of the first wake with it; a cancelled pause is dropped."""
    pacer = Pacer()
    woke: dict[str, float] = {}
    start = trio.current_time()

    async def paused(name: str, after: float) -> None:
        await pacer.pause(start + after)
        woke[name] = trio.current_time() - start

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        for name, after in (("a", 1.0), ("b", 1.0 + PACING_QUANTUM / 2), ("c", 3.0)):
            nursery.start_soon(paused, name, after)
        await trio.sleep(0.1)
        nursery.start_soon(paused, "early", 0.5)
        with trio.move_on_after(1.0):
            await pacer.pause(start + 2.0)  # cancelled at 1.1 s: never woken
        await trio.sleep(5)
        assert len(pacer.due) == 0
        nursery.cancel_scope.cancel()
    assert woke == {"early": 0.5, "a": 1.0, "b": 1.0, "c": 3.0}


@pytest.mark.req("overload-ops")
async def test_a_bunch_of_paused_connections_wakes_over_several_scheduling_rounds(
    mock_clock: trio.testing.MockClock,
) -> None:
    """[overload-ops] Connections due in one moment are woken at most ``PACING_BATCH`` per
    scheduling round: the first of a bunch run while the rest still wait, and other tasks (a
    ``/healthz``) get the loop between the rounds."""
    pacer = Pacer()
    waiting_when_woken: list[int] = []  # paused connections still queued when each one ran
    start = trio.current_time()
    bunch = 2 * PACING_BATCH + PACING_BATCH // 2

    async def paused() -> None:
        await pacer.pause(start + 1.0)
        waiting_when_woken.append(len(pacer.due))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        for _ in range(bunch):
            nursery.start_soon(paused)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(1.0)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert len(waiting_when_woken) == bunch and len(pacer.due) == 0
    assert min(waiting_when_woken[:PACING_BATCH]) >= bunch - 2 * PACING_BATCH  # the first batch ran early
    assert waiting_when_woken[-1] == 0


async def _listener(nursery: trio.Nursery, seen: list[str], counter: ConnectionCounter, pause: float) -> int:
    """A listener whose ``refuse_head`` refuses ``POST /full`` with :data:`FULL` (paused ``pause`` s)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    def refuse_head(method: bytes, target: bytes, headers: object) -> tuple[CannedResponse, float] | None:
        return (FULL, trio.current_time() + pause) if (method, target) == (b"POST", b"/full") else None

    port: int = await nursery.start(
        lambda task_status: serve_http(
            app,
            "127.0.0.1",
            0,
            limits=HttpLimits(header_timeout=5),
            counter=counter,
            refuse_head=refuse_head,
            task_status=task_status,
        )
    )
    return port


@pytest.mark.req("overload-cheap-reject")
async def test_a_request_refused_on_its_head_never_reaches_the_app() -> None:
    """[overload-cheap-reject] A refused request is answered with the canned bytes as they are, its
    body skipped, without the app; the pipelined request behind it is served on the same connection.
    A body still on its way is refused all the same and the connection closed (where the body ends is
    the client's word only); after ``connection: close`` the connection ends."""
    seen: list[str] = []
    counter = ConnectionCounter(limit=10)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await _listener(nursery, seen, counter, pause=-1.0)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            buffer = bytearray()
            refused = b"POST /full HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello"
            await stream.send_all(refused + b"GET /after HTTP/1.1\r\nhost: x\r\n\r\n")
            assert await _read_response(stream, buffer) == (429, b"full", 1)
            assert (await _read_response(stream, buffer))[:2] == (200, b"ok")
            assert seen == ["/after"]
            # The body comes later: refused at once all the same, and the connection closes.
            await stream.send_all(b"POST /full HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n012")
            answer = b""
            while data := await stream.receive_some():
                answer += data
            assert answer == FULL.closing
            await stream.aclose()
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"GET /next HTTP/1.1\r\nhost: x\r\n\r\n")
            assert (await _read_response(stream, bytearray()))[:2] == (200, b"ok")
            await stream.send_all(b"POST /full HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
            answer = b""
            while data := await stream.receive_some():
                answer += data
            assert answer == FULL.closing
            assert seen == ["/after", "/next"]
            await stream.aclose()
            await eventually(lambda: counter.open == 0)
            nursery.cancel_scope.cancel()


@pytest.mark.req("overload-cheap-reject", "overload-admitted-first")
async def test_a_connection_refused_on_its_head_is_paced() -> None:
    """[overload-cheap-reject] [overload-admitted-first] After a refusal on the head, the connection's
    next request waits unread until the refusal's pause time (counted as paused); other connections
    are served meanwhile; stopping the listener ends the pause."""
    seen: list[str] = []
    counter = ConnectionCounter(limit=10)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await _listener(nursery, seen, counter, pause=3600.0)
            paced = await trio.open_tcp_stream("127.0.0.1", port)
            await paced.send_all(b"POST /full HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
            assert (await _read_response(paced, bytearray()))[:2] == (429, b"full")
            await paced.send_all(b"GET /waits HTTP/1.1\r\nhost: x\r\n\r\n")
            await eventually(lambda: counter.paused == 1)
            other = await trio.open_tcp_stream("127.0.0.1", port)
            await other.send_all(b"GET /other HTTP/1.1\r\nhost: x\r\n\r\n")
            assert (await _read_response(other, bytearray()))[:2] == (200, b"ok")
            await trio.testing.wait_all_tasks_blocked()
            assert seen == ["/other"] and (counter.open, counter.paused) == (2, 1)
            nursery.cancel_scope.cancel()
    assert (counter.open, counter.paused) == (0, 0)
    await paced.aclose()
    await other.aclose()

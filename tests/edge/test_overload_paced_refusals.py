"""Refusals answered by the listener's pacer: when a paused connection is due and the client sent
again exactly a request refused before, the pacer's task asks ``refuse_head`` and answers it
itself, pausing the connection again, without its task or a new parse; anything else goes to the
connection's task as after any pause.

On trio's ``MockClock`` (no time passes but the pauses'), the connection on a Unix socket pair:
bytes written are in the peer's buffer when the write returns, so what a pause's end finds to read
does not depend on timing.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
import trio
import trio.testing

from edge.test_http_server import _read_response
from edge.test_refuse_head import FULL
from iop_edge.listener.asgi import CONNECTION
from iop_edge.listener.pacing import RECHECK_AFTER, RECHECKS, Pacer
from iop_edge.listener.server import (
    CannedResponse,
    ConnectionCounter,
    HttpLimits,
    _Connection,
)
from iop_io import SocketTransport

REFUSED = b"POST /full HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello"


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


async def _refused_only(scope: dict[str, Any], receive: Any, send: Any) -> None:
    raise AssertionError("every request is refused")


def _refusing(response: CannedResponse) -> Any:
    """A ``refuse_head`` that refuses every request with ``response``, paused 1 s."""

    def refuse_head(method: bytes, target: bytes, headers: object) -> tuple[CannedResponse, float]:
        return response, trio.current_time() + 1.0

    return refuse_head


def _connection(pacer: Pacer, app: Any, refuse_head: Any) -> tuple[_Connection, trio.SocketStream]:
    """A listener's connection over a Unix socket pair (paced by ``pacer``), and its client's end."""
    ours, theirs = socket.socketpair()
    server = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
    client = trio.SocketStream(trio.socket.from_stdlib_socket(theirs))
    limits = HttpLimits(header_timeout=5)
    connection = _Connection(SocketTransport(server), app, limits, ConnectionCounter(10), pacer, refuse_head)
    return connection, client


async def test_a_paused_connection_has_its_answer_extend_the_pause(clock: trio.testing.MockClock) -> None:
    """The pacer asks a pause's ``answer`` when it is due: a later time keeps the task asleep until
    then; None, or an answer that raised, wakes it."""
    pacer = Pacer()
    answers = [2.0, 3.5, None, 5.0]
    asked: list[float] = []
    start = trio.current_time()

    def answer(due: float) -> float | None:
        assert due <= trio.current_time()
        asked.append(trio.current_time() - start)
        later = answers.pop(0)
        return None if later is None else start + later

    def broken(due: float) -> float | None:
        raise RuntimeError("boom")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        await pacer.pause(start + 1.0, answer)
        assert trio.current_time() - start == 3.5 and asked == [1.0, 2.0, 3.5]
        await pacer.pause(start + 4.0, broken)
        assert trio.current_time() - start == 4.0
        nursery.cancel_scope.cancel()


@pytest.mark.req("overload-cheap-reject")
async def test_a_refused_retry_is_answered_by_the_pacer_without_the_connections_task(
    clock: trio.testing.MockClock,
) -> None:
    """[overload-cheap-reject] The first refusal after a pause goes through the connection's task
    (the reader reads it; the pacer remembers it by its bytes); the same bytes again are answered from the
    pacer's task, paused again each time. The same bytes no longer refused go to the app; a request
    that differs, or comes in pieces, is parsed by the connection's task; a client that leaves
    during a pause ends the connection."""
    pacer = Pacer()
    refuse = [True]
    decided_in: list[str] = []  # which task asked refuse_head
    seen: list[str] = []
    let_through: list[bool] = []  # the app's scope says refuse_head let the request through

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["path"])
        let_through.append(scope["extensions"][CONNECTION].head_let_through)
        while (await receive())["more_body"]:
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    def refuse_head(method: bytes, target: bytes, headers: object) -> tuple[CannedResponse, float] | None:
        decided_in.append("pacer" if "Pacer.run" in trio.lowlevel.current_task().name else "connection")
        if refuse[0] and (method, target) == (b"POST", b"/full"):
            return FULL, trio.current_time() + 1.0
        return None

    connection, client = _connection(pacer, app, refuse_head)
    buffer = bytearray()

    async def ask(request: bytes) -> tuple[int, bytes]:
        await client.send_all(request)
        status, body, _ = await _read_response(client, buffer)
        return status, body

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pacer.run)
            async with trio.open_nursery() as serving:
                serving.start_soon(connection.serve)
                assert await ask(REFUSED) == (429, b"full")  # not paused before: its task
                assert await ask(REFUSED) == (429, b"full")  # after the pause: parsed by its task, remembered
                assert await ask(REFUSED) == (429, b"full")
                assert await ask(REFUSED) == (429, b"full")
                assert decided_in == ["connection", "connection", "pacer", "pacer"]
                assert seen == [] and len(pacer.due) == 1
                refuse[0] = False
                # Remembered, not refused now: the app answers, and the pacer's decision stands (its
                # task does not ask again; the scope tells the app it was let through).
                assert await ask(REFUSED) == (200, b"ok")
                assert seen == ["/full"] and decided_in[4:] == ["pacer"] and let_through == [True]
                refuse[0] = True
                assert await ask(REFUSED) == (429, b"full")  # not paused: its task
                await client.send_all(REFUSED[:20])  # in pieces: the pause ends on the first
                clock.jump(1.0)
                await trio.testing.wait_all_tasks_blocked()
                assert await ask(REFUSED[20:]) == (429, b"full")
                other = REFUSED.replace(b"hello", b"world")
                assert await ask(other) == (429, b"full")  # not remembered: its task
                assert decided_in[5:] == ["connection", "connection", "connection"]
                # Nothing to read when the pause ends: looked at again RECHECK_AFTER later (or, the
                # pacer running late, at the next such step still ahead) ...
                for step in (1.0 + RECHECK_AFTER * 1.5, *[RECHECK_AFTER] * (RECHECKS - 2)):
                    clock.jump(step)
                    await trio.testing.wait_all_tasks_blocked()
                    assert len(pacer.due) == 1
                assert await ask(other) == (429, b"full")  # ... and answered there
                # ... up to RECHECKS times; then its task waits for the socket, and answers a
                # remembered request the same way, without its reader.
                for step in (1.0, *[RECHECK_AFTER] * RECHECKS):
                    clock.jump(step)
                    await trio.testing.wait_all_tasks_blocked()
                assert len(pacer.due) == 0
                assert connection.reader.at_rest
                assert await ask(other) == (429, b"full")
                assert connection.reader.at_rest and len(pacer.due) == 1  # the reader never saw the bytes
                assert decided_in[8:] == ["pacer", "connection"]
                await client.aclose()
            nursery.cancel_scope.cancel()  # the connection ended (its client left during a pause)
    assert len(pacer.due) == 0


@pytest.mark.req("overload-cheap-reject")
async def test_a_client_told_to_come_back_after_its_pause_is_looked_at_then(clock: trio.testing.MockClock) -> None:
    """[overload-cheap-reject] A client told ``Retry-After: 2`` whose connection's pause ended after
    1 s with nothing to read is looked at again right after the 2 s (not waited for on the socket):
    a client that honours the ``Retry-After`` is read there. One that never comes back is closed
    after the keep-alive timeout."""
    told = CannedResponse(429, [(b"retry-after", b"2"), (b"content-length", b"4")], b"full", retry_after=2)
    pacer = Pacer()
    connection, client = _connection(pacer, _refused_only, _refusing(told))
    buffer = bytearray()
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pacer.run)
            nursery.start_soon(connection.serve)
            await client.send_all(REFUSED)
            assert (await _read_response(client, buffer))[0] == 429
            start = trio.current_time()
            for step in (1.0, *[RECHECK_AFTER] * RECHECKS):
                clock.jump(step)
                await trio.testing.wait_all_tasks_blocked()
            assert len(pacer.due) == 1  # the look at the time it was told
            await client.send_all(REFUSED)
            assert (await _read_response(client, buffer))[0] == 429
            assert 2.0 < trio.current_time() - start <= 2.0 + 2 * RECHECK_AFTER
            # A client that never comes back: once the pacer stopped looking, its connection
            # waits as long as an idle kept-alive connection does, then closes.
            start = trio.current_time()
            assert await client.receive_some() == b""
            assert trio.current_time() - start >= 2.0 + connection.limits.keep_alive_timeout
            nursery.cancel_scope.cancel()
    await client.aclose()

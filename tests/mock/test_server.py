"""The mock backend's own pieces: its pacer (on virtual time) and its HTTP/1.1 server (on loopback)."""

from __future__ import annotations

import functools
import json
import socket

import pytest
import trio
import trio.testing

from iop_mock import MockBackend, Pacer, serve_asgi, serve_mock_backend

TIMEOUT = 10.0


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


async def test_pacer_wakes_each_waiter_on_time_sharing_wakeups(autojump_clock: trio.testing.MockClock) -> None:
    """The earliest due time is kept exactly; a waiter due within ``slack`` after it goes with it."""
    pacer = Pacer(slack=0.001)
    start = trio.current_time()
    woke: dict[str, float] = {}

    async def wait(name: str, due: float) -> None:
        await pacer.wait_until(start + due)
        woke[name] = round(trio.current_time() - start, 6)

    async with trio.open_nursery() as nursery:
        for name, due in (("c", 0.3), ("a", 0.1), ("b", 0.1005), ("d", 0.2)):
            nursery.start_soon(wait, name, due)
    assert woke == {"a": 0.1, "b": 0.1, "d": 0.2, "c": 0.3}


async def test_pacer_cancelled_waiter_leaves_the_others_on_time(autojump_clock: trio.testing.MockClock) -> None:
    pacer = Pacer()
    start = trio.current_time()
    woke: list[tuple[str, float]] = []

    async def wait(name: str, due: float, give_up: float = 1.0) -> None:
        with trio.move_on_after(give_up):
            await pacer.wait_until(start + due)
            woke.append((name, round(trio.current_time() - start, 6)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait, "gives up", 0.1, 0.05)
        nursery.start_soon(wait, "late", 0.2)
        await trio.sleep(0.06)
        nursery.start_soon(wait, "early", 0.15)  # after the cancelled one: moves the ticker's deadline
    assert woke == [("early", 0.15), ("late", 0.2)]


async def test_pacer_due_time_passed_returns_at_once(autojump_clock: trio.testing.MockClock) -> None:
    pacer = Pacer()
    now = trio.current_time()
    await pacer.wait_until(now - 1.0)
    assert trio.current_time() == now


async def test_streams_keep_the_rate_on_one_pacer(autojump_clock: trio.testing.MockClock) -> None:
    """Many concurrent paced streams of one backend: each token on its own schedule, never late."""
    backend = MockBackend(latency=0.0, tokens_per_second=20)
    sent: dict[int, list[float]] = {}

    async def stream(index: int) -> None:
        await trio.sleep(index * 0.0103)  # spread the starts
        times: list[float] = []
        body = json.dumps({"max_tokens": 5, "stream": True}).encode()
        given = False

        async def receive() -> dict[str, object]:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await trio.sleep_forever()
            raise AssertionError("unreachable")

        async def send(message: dict[str, object]) -> None:
            if message["type"] == "http.response.body":
                times.append(trio.current_time())

        await backend.app({"type": "http", "method": "POST", "path": "/v1/completions"}, receive, send)
        sent[index] = times

    async with trio.open_nursery() as nursery:
        for index in range(10):
            nursery.start_soon(stream, index)
    for times in sent.values():
        head, tokens = times[0], times[1:-1]
        for k, at in enumerate(tokens, 1):
            assert head + k * 0.05 - 0.001 - 1e-9 <= at <= head + k * 0.05 + 1e-9
    assert backend.stats() == {"in_flight": 0, "peak_in_flight": 10, "total": 10, "aborted": 0}


# --- the HTTP server, over loopback -------------------------------------------------------------


async def _exchange(port: int, request: bytes, until: bytes, times: int = 1) -> bytes:
    """Send ``request`` on a new connection; read until ``until`` was seen ``times`` times (or EOF)."""
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(request)
        received = b""
        while received.count(until) < times:
            chunk = await stream.receive_some()
            if not chunk:
                break
            received += chunk
        return received


async def test_server_keeps_alive_answers_100_continue_and_refuses_garbage(nursery: trio.Nursery) -> None:
    backend = MockBackend()
    with trio.fail_after(TIMEOUT):
        port = await nursery.start(serve_mock_backend, backend)
        two = b"GET /v1/models HTTP/1.1\r\nhost: m\r\n\r\n" * 2  # pipelined on one connection
        answer = await _exchange(port, two, b"}]}", times=2)
        assert answer.count(b"HTTP/1.1 200 ") == 2
        body = b'{"max_tokens": 2}'
        head = b"POST /v1/completions HTTP/1.1\r\nhost: m\r\nexpect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(
            body
        )
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            await stream.send_all(head)
            assert (await stream.receive_some()).startswith(b"HTTP/1.1 100 ")
            await stream.send_all(body)
            received = b""
            while b"tok tok " not in received:
                received += await stream.receive_some()
            assert received.startswith(b"HTTP/1.1 200 ")
        refused = await _exchange(port, b"NOT HTTP AT ALL\r\n\r\n", b"bad request")
        assert refused.startswith(b"HTTP/1.1 400 ")
    assert backend.stats()["in_flight"] == 0


async def test_server_closes_a_connection_idle_past_keep_alive(nursery: trio.Nursery) -> None:
    """A connection that sends nothing of its next request is closed, after a response too."""
    backend = MockBackend()
    with trio.fail_after(TIMEOUT):
        port = await nursery.start(functools.partial(serve_asgi, backend.app, "127.0.0.1", 0, keep_alive_timeout=0.05))
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            await stream.send_all(b"GET /stats HTTP/1.1\r\nhost: m\r\n\r\n")
            received = b""
            while chunk := await stream.receive_some():
                received += chunk
        assert received.startswith(b"HTTP/1.1 200 ") and received.endswith(b'"aborted":0}')
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            assert await stream.receive_some() == b""


async def test_server_serves_every_connection_that_waited_for_its_accept(nursery: trio.Nursery) -> None:
    """Connections opened while the server's task does not run (the kernel completes them) are
    accepted together at its next wake-up, each served on its own."""
    backend = MockBackend()
    with trio.fail_after(TIMEOUT):
        port = await nursery.start(serve_mock_backend, backend)
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]  # blocking: no checkpoint
        streams = [trio.SocketStream(trio.socket.from_stdlib_socket(sock)) for sock in clients]
        for stream in streams:
            await stream.send_all(b"GET /stats HTTP/1.1\r\nhost: m\r\nconnection: close\r\n\r\n")
        for stream in streams:
            received = b""
            while chunk := await stream.receive_some():
                received += chunk
            assert received.startswith(b"HTTP/1.1 200 ")
            await stream.aclose()


async def test_server_frames_requests_as_iop_http_does(nursery: trio.Nursery) -> None:
    """A chunked body is decoded; a head iop_http refuses (both framings, a folded line) is answered with
    its fixed refusal and the connection closes, so a request pipelined behind it never runs."""
    backend = MockBackend()
    with trio.fail_after(TIMEOUT):
        port = await nursery.start(serve_mock_backend, backend)
        chunked = b"POST /v1/completions HTTP/1.1\r\nhost: m\r\ntransfer-encoding: chunked\r\n\r\n"
        chunked += b'7\r\n{"max_t\r\na\r\nokens": 1}\r\n0\r\n\r\n'
        answer = await _exchange(port, chunked, b"tok")
        assert answer.startswith(b"HTTP/1.1 200 ")
        marker = b"GET /stats HTTP/1.1\r\nhost: m\r\n\r\n"
        for head in (
            b"POST /v1/completions HTTP/1.1\r\nhost: m\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n",
            b"GET /stats HTTP/1.1\r\nhost: m\r\nx-a: 1\r\n  sneaked\r\n\r\n",
            b"POST /v1/completions HTTP/1.1\r\nhost: m\r\ntransfer-encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n",
        ):
            refused = await _exchange(port, head + marker, b"\x00never")  # read to EOF: the server closes
            assert refused.startswith(b"HTTP/1.1 400 ") and refused.count(b"HTTP/1.1") == 1, refused
            assert b"connection: close" in refused and b"sneaked" not in refused
    assert backend.stats()["total"] == 1

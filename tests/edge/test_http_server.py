"""The Edge's HTTP/1.1 listener (iop_http's request reader on trio sockets; h11 is the test client): keep-alive, one send per response,
chunked bodies, ``expect: 100-continue``, the body limit, the connection cap.

Real sockets on 127.0.0.1 port 0, bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import h11
import pytest
import trio
import trio.testing

from edge.harness import FAST, EdgeLayout, eventually, fake_node, h11_answer, running_edge
from iop_edge.listener import server as _http_server
from iop_edge.listener.asgi import CONNECTION
from iop_edge.listener.cycle import PAUSE_READING
from iop_edge.listener.server import (
    ConnectionCounter,
    HttpLimits,
    serve_http,
)
from iop_io import WRITE_BUFFER_LIMIT, accept_waiting


async def _read_response(stream: trio.SocketStream, buffer: bytearray) -> tuple[int, bytes, int]:
    """One response (content-length framed) from ``stream``; returns (status, body, chunks received)."""
    received = 0
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some()
        assert data, f"connection closed early after {bytes(buffer)!r}"
        buffer += data
        received += 1
    end = buffer.index(b"\r\n\r\n")
    head = bytes(buffer[:end]).split(b"\r\n")
    del buffer[: end + 4]
    status = int(head[0].split(b" ")[1])
    length = 0
    for line in head[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(buffer) < length:
        data = await stream.receive_some()
        assert data, "connection closed mid-body"
        buffer += data
        received += 1
    body = bytes(buffer[:length])
    del buffer[:length]
    return status, body, received


async def test_head_and_body_arrive_together_and_the_connection_is_kept(tmp_path: Path) -> None:
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge:
            stream = await trio.open_tcp_stream("127.0.0.1", edge.http_port)
            async with stream:
                buffer = bytearray()
                for _ in range(3):
                    await stream.send_all(b"GET /healthz HTTP/1.1\r\nhost: edge\r\n\r\n")
                    status, body, chunks = await _read_response(stream, buffer)
                    assert (status, body, chunks) == (200, b'{"status":"ok"}', 1)


async def test_head_request_is_answered_without_a_body(tmp_path: Path) -> None:
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge:
            stream = await trio.open_tcp_stream("127.0.0.1", edge.http_port)
            async with stream:
                await stream.send_all(b"HEAD /healthz HTTP/1.1\r\nhost: edge\r\n\r\n")
                data = b""
                while b"\r\n\r\n" not in data:
                    data += await stream.receive_some()
                assert data.startswith(b"HTTP/1.1 405")
                assert data.endswith(b"\r\n\r\n")  # no body after the head
                await stream.send_all(b"GET /healthz HTTP/1.1\r\nhost: edge\r\n\r\n")
                status, body, _ = await _read_response(stream, bytearray())
                assert (status, body) == (200, b'{"status":"ok"}')


async def test_chunked_body_and_100_continue_reach_the_app(tmp_path: Path) -> None:
    """A chunked body with ``expect: 100-continue``: 100 comes when the body is wanted."""
    body = json.dumps({"model": FAST, "messages": [{"role": "user", "content": "hi"}]}).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\nexpect: 100-continue\r\n\r\n"
    )
    with trio.fail_after(20):
        async with running_edge(tmp_path) as edge, fake_node(edge, "node-a") as node:
            stream = await trio.open_tcp_stream("127.0.0.1", edge.http_port)
            async with stream:
                await stream.send_all(head)
                interim = b""
                while b"\r\n\r\n" not in interim:
                    interim += await stream.receive_some()
                assert interim.startswith(b"HTTP/1.1 100 ")
                half = len(body) // 2
                for part in (body[:half], body[half:]):
                    await stream.send_all(b"%x\r\n%s\r\n" % (len(part), part))
                await stream.send_all(b"0\r\n\r\n")
                run = await node.next_run()
                assert run.body["messages"] == [{"role": "user", "content": "hi"}]
                await node.answer(run, "chunked ok")
                status, answer, _ = await _read_response(stream, bytearray())
                assert status == 200, answer
                assert json.loads(answer)["choices"][0]["message"]["content"] == "chunked ok"


async def test_rejected_before_the_body_no_100_continue_is_sent(tmp_path: Path) -> None:
    """A request refused before its body is read (401) never invites the body."""
    layout = EdgeLayout(api_keys=("k-1",))
    with trio.fail_after(10):
        async with running_edge(tmp_path, layout) as edge:
            stream = await trio.open_tcp_stream("127.0.0.1", edge.http_port)
            async with stream:
                await stream.send_all(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ncontent-length: 100000\r\n"
                    b"expect: 100-continue\r\n\r\n"
                )
                status, _, _ = await _read_response(stream, bytearray(b""))
                assert status == 401


async def test_chunked_body_over_the_limit_is_refused(tmp_path: Path) -> None:
    layout = EdgeLayout(max_body_bytes=1000)
    with trio.fail_after(10):
        async with running_edge(tmp_path, layout) as edge:
            stream = await trio.open_tcp_stream("127.0.0.1", edge.http_port)
            async with stream:
                await stream.send_all(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ntransfer-encoding: chunked\r\n\r\n"
                    + b"%x\r\n%s\r\n" % (1500, b"x" * 1500)
                )
                status, body, _ = await _read_response(stream, bytearray())
                assert status == 413
                assert json.loads(body)["error"]["code"] == "request_too_large"


def test_one_wake_up_accepts_every_connection_waiting_up_to_the_batch() -> None:
    """The listener takes every connection the kernel holds in one call (trio's accept takes one
    per scheduling round), at most ``limit``; nothing waiting: none, without blocking."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as listener:
        listener.setblocking(False)
        assert accept_waiting(listener) == []
        clients = [socket.create_connection(listener.getsockname()) for _ in range(20)]
        accepted: list[socket.socket] = []
        try:
            accepted += accept_waiting(listener, limit=15)
            assert len(accepted) == 15
            accepted += accept_waiting(listener)
            assert len(accepted) == 20
            assert accept_waiting(listener) == []
            assert sorted(sock.getpeername() for sock in accepted) == sorted(c.getsockname() for c in clients)
        finally:
            for sock in accepted + clients:
                sock.close()


@pytest.mark.req("overload-shed")
async def test_connections_past_the_cap_are_closed_at_once() -> None:
    """[overload-shed] Past ``max_connections`` a new connection is closed before a byte is read."""

    async def app(scope: object, receive: object, send: object) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]

    counter = ConnectionCounter(limit=1)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(
                lambda task_status: serve_http(
                    app, "127.0.0.1", 0, limits=HttpLimits(header_timeout=5), counter=counter, task_status=task_status
                )
            )
            first = await trio.open_tcp_stream("127.0.0.1", port)
            await first.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            assert (await _read_response(first, bytearray()))[:2] == (200, b"ok")
            second = await trio.open_tcp_stream("127.0.0.1", port)
            assert await second.receive_some() == b""  # closed by the server, unanswered
            assert (counter.open, counter.refused) == (1, 1)
            await second.aclose()
            await first.aclose()
            await eventually(lambda: counter.open == 0)
            third = await trio.open_tcp_stream("127.0.0.1", port)
            await third.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            assert (await _read_response(third, bytearray()))[0] == 200
            await third.aclose()
            nursery.cancel_scope.cancel()


@pytest.mark.req("overload-admitted-first")
async def test_a_paced_connection_is_not_read_until_its_time() -> None:
    """[overload-admitted-first] A response whose scope sets ``PAUSE_READING`` (a time on trio's
    clock) leaves that connection unread until then: its next request waits in the socket,
    counted as paused, while other connections are served; a time already past pauses nothing.
    Cancelling the listener ends the pause and the counts."""
    seen: list[str] = []

    async def app(scope: dict[str, Any], receive: object, send: Any) -> None:
        seen.append(scope["path"])
        if scope["path"] == "/refuse":
            scope[PAUSE_READING] = trio.current_time() + 3600
        elif scope["path"] == "/past":
            scope[PAUSE_READING] = trio.current_time() - 1
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    counter = ConnectionCounter(limit=10)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(
                lambda task_status: serve_http(
                    app, "127.0.0.1", 0, limits=HttpLimits(header_timeout=5), counter=counter, task_status=task_status
                )
            )
            paced = await trio.open_tcp_stream("127.0.0.1", port)
            await paced.send_all(b"GET /refuse HTTP/1.1\r\nhost: x\r\n\r\n")
            assert (await _read_response(paced, bytearray()))[:2] == (200, b"ok")
            await paced.send_all(b"GET /next HTTP/1.1\r\nhost: x\r\n\r\n")
            await eventually(lambda: counter.paused == 1)
            await trio.testing.wait_all_tasks_blocked()
            assert seen == ["/refuse"]  # the second request waits unread
            other = await trio.open_tcp_stream("127.0.0.1", port)
            for path in (b"/past", b"/healthz"):
                await other.send_all(b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % path)
                assert (await _read_response(other, bytearray()))[0] == 200
            assert seen == ["/refuse", "/past", "/healthz"]
            assert (counter.open, counter.paused) == (2, 1)
            nursery.cancel_scope.cancel()
    assert (counter.open, counter.paused) == (0, 0)
    await paced.aclose()
    await other.aclose()


async def _serve(nursery: trio.Nursery, app: object) -> int:
    port: int = await nursery.start(
        lambda task_status: serve_http(
            app, "127.0.0.1", 0, limits=HttpLimits(header_timeout=5), task_status=task_status
        )  # type: ignore[arg-type]
    )
    return port


async def _chunked_body(stream: trio.SocketStream) -> tuple[int, bytes]:
    """Read one response with an h11 client; returns (status, body)."""
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    status, body = 0, bytearray()
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            client.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return status, bytes(body)


async def test_body_written_without_waiting_keeps_its_order_and_its_bound() -> None:
    """``write_body_nowait`` writes chunks from another task without waiting: a client that
    does not read gets them buffered, in order with the app's own sends, and the writer is told
    (False) once more than ``WRITE_BUFFER_LIMIT`` bytes wait -- the bound a relay acts on."""
    chunk = 16 * 1024
    written: list[bytes] = []
    refused = trio.Event()

    async def app(scope: dict[str, Any], receive: object, send: Any) -> None:
        write_nowait = scope["extensions"][CONNECTION].write_body_nowait
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first;", "more_body": True})

        async def writer() -> None:  # as a node link's reader would: another task, never waiting
            for i in range(4096):
                data = f"{i:08d}".encode() * (chunk // 8)
                written.append(data)
                if not write_nowait(data):
                    refused.set()
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
        await send({"type": "http.response.body", "body": b";last", "more_body": False})

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, app)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            await refused.wait()  # the client has read nothing so far
            assert len(written) * chunk > WRITE_BUFFER_LIMIT
            assert len(written) < 4096  # refused long before the writer ran out: memory is bounded
            status, body = await _chunked_body(stream)
            assert status == 200
            assert body == b"first;" + b"".join(written) + b";last"
            await stream.aclose()
            nursery.cancel_scope.cancel()


async def test_a_whole_response_written_from_another_task_goes_out_before_the_app_returns() -> None:
    """``respond_nowait`` writes a whole response at once from another task (as a node link's
    reader answers a non-stream run): the client has it while the app still runs, and a second
    response is refused. The client's leaving after that does not cancel the app (its disconnect
    watch ended with the answer), and a next request it sent meanwhile is served once the app
    returned."""
    answered = trio.Event()
    calls: list[str] = []

    async def app(scope: dict[str, Any], receive: object, send: Any) -> None:
        extensions = scope["extensions"]
        if scope["path"] == "/next":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
            await send({"type": "http.response.body", "body": b"next", "more_body": False})
            return

        async def reader() -> None:  # another task, never waiting
            assert extensions[CONNECTION].respond_nowait(200, [(b"content-length", b"5")], b"whole")
            assert not extensions[CONNECTION].respond_nowait(200, [(b"content-length", b"5")], b"again")

        with trio.CancelScope() as watched:
            extensions[CONNECTION].cancel_on_disconnect(watched)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader)
            await answered.wait()  # the client read the answer, sent another request and left
            calls.append("returned")
        calls.append("cancelled" if watched.cancelled_caught else "not cancelled")

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, app)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            buffer = bytearray()
            await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            assert (await _read_response(stream, buffer))[:2] == (200, b"whole")
            await stream.send_all(b"GET /next HTTP/1.1\r\nhost: x\r\n\r\n")
            await stream.send_eof()
            await trio.testing.wait_all_tasks_blocked()
            assert calls == []
            answered.set()
            assert (await _read_response(stream, buffer))[:2] == (200, b"next")
            assert calls == ["returned", "not cancelled"]
            assert await stream.receive_some() == b""  # the client's end closes the connection
            await stream.aclose()
            nursery.cancel_scope.cancel()


async def test_requests_read_without_waiting_still_pass_one_schedule_point_each() -> None:
    """A request whose bytes are there already is read without a timer, but the connection's
    task still lets the others run once per request: 20 requests pipelined in one send, answered
    by an app that never waits, are served over as many scheduling rounds (another task, which
    runs once a round, counts them), not in one step."""
    rounds = 0
    seen: list[int] = []

    async def ticker() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            await trio.lowlevel.checkpoint()

    async def app(scope: dict[str, Any], receive: object, send: Any) -> None:
        seen.append(rounds)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, app)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            nursery.start_soon(ticker)
            await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n" * 20)
            buffer = bytearray()
            for _ in range(20):
                assert (await _read_response(stream, buffer))[:2] == (200, b"ok")
            assert len(seen) == 20
            assert seen[-1] - seen[1] >= 17  # one round per request (the ticker's place in a round varies)
            await stream.aclose()
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("request_head", "headers", "reusable"),
    [
        (b"GET / HTTP/1.1\r\nhost: x\r\n\r\n", [], True),  # no content-length: chunks
        (b"GET / HTTP/1.1\r\nhost: x\r\n\r\n", [(b"content-length", b"17")], True),  # framed by its content-length
        (b"GET / HTTP/1.0\r\n\r\n", [], False),  # HTTP/1.0: the body ends with the connection
    ],
)
async def test_body_chunks_are_framed_as_h11_frames_the_response(
    request_head: bytes, headers: list[tuple[bytes, bytes]], reusable: bool
) -> None:
    """Body chunks written by the app and by ``write_body_nowait`` (empty ones too) reach an
    h11 client whole and in order, whichever framing h11 chose for the response; a kept-alive
    connection then serves its next request."""

    async def app(scope: dict[str, Any], receive: object, send: Any) -> None:
        write_nowait = scope["extensions"][CONNECTION].write_body_nowait
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"one;", "more_body": True})
        assert write_nowait(b"two;") and write_nowait(b"") and write_nowait(b"three;")
        await send({"type": "http.response.body", "body": b"", "more_body": True})
        await send({"type": "http.response.body", "body": b"end", "more_body": False})

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, app)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            client = h11.Connection(h11.CLIENT)
            for _ in range(2 if reusable else 1):
                await stream.send_all(request_head)
                client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
                client.send(h11.EndOfMessage())
                _, body = await h11_answer(client, stream)
                assert body == b"one;two;three;end"
                if reusable:
                    client.start_next_cycle()
            await stream.aclose()
            nursery.cancel_scope.cancel()


@pytest.fixture(params=["listener poller", "task per connection"])
def watch_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a connection is watched: the listener's one epoll poller (Linux), or a watcher
    task per connection (elsewhere)."""
    kind: str = request.param
    if kind == "task per connection":
        monkeypatch.setattr(_http_server, "CAN_POLL", False)
    return kind


async def test_the_connection_watcher_cancels_a_request_whose_client_left(watch_kind: str) -> None:
    """``cancel_on_disconnect``: the client closing its end while the app waits cancels the
    app's scope (no task of the app's watches); the connection then ends."""
    cancelled = trio.Event()
    waiting = trio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "http.request"
        with trio.CancelScope() as cancel_scope:
            scope["extensions"][CONNECTION].cancel_on_disconnect(cancel_scope)
            waiting.set()
            await trio.sleep_forever()
        assert cancel_scope.cancelled_caught
        cancelled.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, app)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            await waiting.wait()
            await stream.aclose()
            await cancelled.wait()
            nursery.cancel_scope.cancel()


async def test_the_connection_watcher_keeps_a_pipelined_request_and_parks_between_requests(watch_kind: str) -> None:
    """Requests on one keep-alive connection each watched by the connection's one watcher: a next
    request sent while the app still runs is read by the watcher, kept, and served after, in order;
    nothing is cancelled while the client stays."""
    seen: list[str] = []
    release = trio.Event()
    watching = trio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "http.request"
        with trio.CancelScope() as cancel_scope:
            scope["extensions"][CONNECTION].cancel_on_disconnect(cancel_scope)
            seen.append(scope["path"])
            if scope["path"] == "/1":
                watching.set()
                await release.wait()
            await trio.lowlevel.checkpoint()
        assert not cancel_scope.cancelled_caught
        body = scope["path"].encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, app)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                buffer = bytearray()
                await stream.send_all(b"GET /1 HTTP/1.1\r\nhost: x\r\n\r\n")
                await watching.wait()
                await stream.send_all(b"GET /2 HTTP/1.1\r\nhost: x\r\n\r\n")
                await trio.testing.wait_all_tasks_blocked()  # the watcher has read /2 by now
                assert seen == ["/1"]
                release.set()
                assert (await _read_response(stream, buffer))[:2] == (200, b"/1")
                assert (await _read_response(stream, buffer))[:2] == (200, b"/2")
                for n in (3, 4):
                    await stream.send_all(f"GET /{n} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
                    assert (await _read_response(stream, buffer))[:2] == (200, f"/{n}".encode())
                assert seen == ["/1", "/2", "/3", "/4"]
            nursery.cancel_scope.cancel()


async def test_a_streamed_answer_keeps_the_request_read_behind_it_while_watched() -> None:
    """A request answered as a stream of chunks, with the next request the client sent meanwhile read by
    the disconnect watch into the connection's reader: both are answered in order, framed as h11 reads them."""
    release = trio.Event()
    watching = trio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        message = await receive()
        if scope["path"] == "/stream":
            with trio.CancelScope() as cancel_scope:
                scope["extensions"][CONNECTION].cancel_on_disconnect(cancel_scope)
                watching.set()
                await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": message["body"], "more_body": True})
            await send({"type": "http.response.body", "body": b";end", "more_body": False})
        else:
            body = scope["path"].encode()
            headers = [(b"content-length", b"%d" % len(body))]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port: int = await nursery.start(
                lambda task_status: serve_http(
                    app, "127.0.0.1", 0, limits=HttpLimits(header_timeout=5), task_status=task_status
                )
            )
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            client = h11.Connection(h11.CLIENT)
            await stream.send_all(b"POST /stream HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nfirst")
            await watching.wait()
            await stream.send_all(b"GET /next HTTP/1.1\r\nhost: x\r\n\r\n")
            await trio.testing.wait_all_tasks_blocked()  # the watch has read /next by now
            release.set()
            answers = []
            for target in ("/stream", "/next"):
                client.send(h11.Request(method="GET", target=target, headers=[("host", "x")]))
                client.send(h11.EndOfMessage())
                response, body = await h11_answer(client, stream)
                answers.append((body, (b"transfer-encoding", b"chunked") in list(response.headers)))
                client.start_next_cycle()
            assert answers == [(b"first;end", True), (b"/next", False)]
            await stream.aclose()
            nursery.cancel_scope.cancel()


async def _head_and_rest(stream: trio.SocketStream) -> tuple[bytes, bytes]:
    """The response head, then everything after it until the server ends the connection
    (a reset instead of its end fails: the client would lose the answer)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some()
        assert chunk, f"closed before a response head: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    while chunk := await stream.receive_some():
        rest += chunk
    return head.lower(), rest


async def test_a_refusal_sent_before_the_body_ends_says_close_and_lets_the_client_finish(tmp_path: Path) -> None:
    """RFC 9112 9.6: a refusal (413) answered while the body is still coming says ``connection: close``
    (the connection ends: the rest of the body is the client's word only), and the close lingers:
    the client may send the rest of its body, then reads the answer and the connection's end, not a reset."""
    layout = EdgeLayout(max_body_bytes=1000)
    with trio.fail_after(20):
        async with running_edge(tmp_path, layout) as edge:
            stream = await trio.open_tcp_stream("127.0.0.1", edge.http_port)
            async with stream:
                await stream.send_all(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ncontent-type: application/json\r\n"
                    b"content-length: 300000\r\n\r\n" + b"x" * 1500
                )
                data = b""
                while b"\r\n\r\n" not in data:
                    data += await stream.receive_some()
                assert data.startswith(b"HTTP/1.1 413 ")
                assert b"\r\nconnection: close\r\n" in data.lower()
                await stream.send_all(b"x" * (300000 - 1500))  # the rest of the body: read and dropped
                while await stream.receive_some():
                    pass  # the answer's body, then the end of the connection (a reset raises here)


async def test_an_answer_before_an_unread_body_says_whether_the_connection_goes_on() -> None:
    """The app answers without reading the body: a refusal keeps the connection only when the body's
    end is in hand, a success when what is left of the body fits the drain; otherwise the head says
    ``connection: close`` (never a keep-alive answer on a connection that then ends)."""

    async def app(scope: dict[str, Any], receive: object, send: Any) -> None:
        status = int(scope["path"].strip("/"))
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    cases = [
        # (status, content-length, body bytes sent with the head, the connection goes on)
        (400, 10, 10, True),  # the body's end is in hand: skipped
        (400, 100_000, 10, False),
        (200, 100, 10, True),  # the rest fits the drain
        (200, 100_000_000, 10, False),
    ]
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _serve(nursery, app)
            for status, length, sent, goes_on in cases:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                async with stream:
                    await stream.send_all(
                        b"POST /%d HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (status, length) + b"x" * sent
                    )
                    if goes_on:
                        await stream.send_all(b"x" * (length - sent))
                        head = b""
                        while b"\r\n\r\nok" not in head:
                            head += await stream.receive_some()
                        assert b"connection: close" not in head.lower(), (status, length)
                        await stream.send_all(b"GET /200 HTTP/1.1\r\nhost: x\r\n\r\n")
                        answer = b""
                        while not answer.endswith(b"ok"):
                            answer += await stream.receive_some()
                        assert answer.startswith(b"HTTP/1.1 200 ")
                    else:
                        head, rest = await _head_and_rest(stream)
                        assert head.startswith(b"http/1.1 %d " % status)
                        assert b"\r\nconnection: close" in head, (status, length)
                        assert rest == b"ok"
            nursery.cancel_scope.cancel()

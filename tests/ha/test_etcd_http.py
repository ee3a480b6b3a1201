"""The etcd gateway's HTTP/1.1 (:class:`iop_edge.ha.etcd_http.EtcdHttp`): kept connections, and
none kept in a state it cannot vouch for. Real sockets on 127.0.0.1, a small h11 server."""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from typing import Literal

import h11
import pytest
import trio
import trustme

from iop_edge.ha.etcd_http import CallFailed, EtcdHttp

BOUND_S = 30
After = Literal["keep", "close", "drop", "junk"]
"""After an answer: keep the connection; say ``connection: close`` and close it; close it without a
word; send bytes nobody asked for."""
Reply = Callable[[h11.Request, bytes], Awaitable[tuple[int, bytes, After] | None]]
"""A request and its body -> (status, body, what follows), or None: no answer (the call hangs)."""


class Server:
    """Answers HTTP/1.1 POSTs with ``reply``; counts the connections it accepted and keeps each request."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.connections = 0
        self.requests: list[tuple[str, bytes, dict[bytes, bytes]]] = []
        self.port = 0
        self.answered = trio.Event()
        """Set after an answer and what follows it (replaced by a new one then)."""

    async def serve(self, tls: ssl.SSLContext | None, *, task_status: trio.TaskStatus[None]) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        if tls is not None:
            await trio.serve_listeners(
                self._connection, [trio.SSLListener(listener, tls) for listener in listeners], task_status=task_status
            )
        else:
            await trio.serve_listeners(self._connection, listeners, task_status=task_status)

    async def _connection(self, stream: trio.abc.Stream) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        async with stream:
            while True:
                request, body = await _read_request(conn, stream)
                if request is None:
                    return
                self.requests.append((request.target.decode(), body, dict(request.headers)))
                answer = await self.reply(request, body)
                if answer is None:
                    await trio.sleep_forever()
                    return
                status, text, after = answer
                headers = [("content-length", str(len(text)))] + ([("connection", "close")] if after == "close" else [])
                data = conn.send(h11.Response(status_code=status, headers=headers))
                data = (data or b"") + (conn.send(h11.Data(data=text)) or b"") + (conn.send(h11.EndOfMessage()) or b"")
                try:
                    await stream.send_all(data + (b"HTTP/1.1 200 OK\r\n" if after == "junk" else b""))
                except trio.BrokenResourceError:  # the client gave up on the answer (too large)
                    return
                if after in ("close", "drop"):
                    await stream.aclose()
                self.answered.set()
                self.answered = trio.Event()
                if after != "keep":
                    return
                conn.start_next_cycle()


async def _read_request(conn: h11.Connection, stream: trio.abc.Stream) -> tuple[h11.Request | None, bytes]:
    request: h11.Request | None = None
    body = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            try:
                conn.receive_data(await stream.receive_some(65536))
            except trio.BrokenResourceError:
                return None, b""
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return request, body
        else:  # the client closed (h11.ConnectionClosed) or broke the protocol
            return None, b""


async def serving(nursery: trio.Nursery, reply: Reply, path: str) -> tuple[Server, str]:
    """A plain-HTTP :class:`Server` started in ``nursery``, and the URL of ``path`` on it."""
    server = Server(reply)
    await nursery.start(server.serve, None)
    return server, f"http://127.0.0.1:{server.port}{path}"


async def echo(request: h11.Request, body: bytes) -> tuple[int, bytes, After]:
    return 200, b'{"echo":' + body + b"}", "keep"


async def test_calls_share_one_kept_connection_and_carry_their_headers(nursery: trio.Nursery) -> None:
    server, url = await serving(nursery, echo, "/v3/lease/keepalive")
    client = EtcdHttp(timeout=BOUND_S)
    with trio.fail_after(BOUND_S):
        for n in range(3):
            status, text = await client.post(url, b'{"ID":"%d"}' % n, [(b"authorization", b"t")])
            assert (status, text) == (200, b'{"echo":{"ID":"%d"}}' % n)
        await client.aclose()
    assert server.connections == 1
    target, body, headers = server.requests[-1]
    assert (target, body) == ("/v3/lease/keepalive", b'{"ID":"2"}')
    assert headers[b"authorization"] == b"t" and headers[b"content-type"] == b"application/json"
    assert headers[b"host"] == f"127.0.0.1:{server.port}".encode()


@pytest.mark.parametrize("after", ["close", "drop", "junk"])
async def test_a_connection_the_server_closed_or_spoiled_is_not_used_again(nursery: trio.Nursery, after: After) -> None:
    """``connection: close``; a kept connection the server closed while it was idle, or on which it
    sent bytes nobody asked for (the client sees it readable before its next call): each next call
    opens a new connection, and succeeds."""

    async def reply(request: h11.Request, body: bytes) -> tuple[int, bytes, After]:
        return 200, b"{}", after

    server, url = await serving(nursery, reply, "/v3/kv/range")
    client = EtcdHttp(timeout=BOUND_S)
    with trio.fail_after(BOUND_S):
        for _ in range(3):
            answered = server.answered
            assert await client.post(url, b"{}") == (200, b"{}")
            await answered.wait()  # what follows the answer is done before the next call
        await client.aclose()
    assert server.connections == 3


async def test_a_call_without_an_answer_fails_at_its_timeout_and_its_connection_is_dropped(
    nursery: trio.Nursery,
) -> None:
    answering = {"now": True}

    async def reply(request: h11.Request, body: bytes) -> tuple[int, bytes, After] | None:
        return (200, b"{}", "keep") if answering["now"] else None

    server, url = await serving(nursery, reply, "/v3/lease/keepalive")
    client = EtcdHttp(timeout=0.2)
    with trio.fail_after(BOUND_S):
        assert await client.post(url, b"{}") == (200, b"{}")
        answering["now"] = False
        with pytest.raises(CallFailed, match=r"no answer within 0\.2 s"):
            await client.post(url, b"{}")
        answering["now"] = True
        client.timeout = BOUND_S
        assert await client.post(url, b"{}") == (200, b"{}")
        await client.aclose()
    assert server.connections == 2  # the call that timed out left its connection half-read: not used again


async def test_a_cancelled_call_leaves_no_connection_kept(nursery: trio.Nursery) -> None:
    hang = trio.Event()

    async def reply(request: h11.Request, body: bytes) -> tuple[int, bytes, After] | None:
        if body == b"hang":
            hang.set()
            return None
        return 200, b"{}", "keep"

    server, url = await serving(nursery, reply, "/v3/kv/txn")
    client = EtcdHttp(timeout=BOUND_S)
    with trio.fail_after(BOUND_S):
        assert await client.post(url, b"{}") == (200, b"{}")
        async with trio.open_nursery() as inner:
            inner.start_soon(client.post, url, b"hang")
            await hang.wait()
            inner.cancel_scope.cancel()
        assert await client.post(url, b"{}") == (200, b"{}")
        await client.aclose()
    assert server.connections == 2


async def test_an_answer_past_its_bound_fails_the_call_and_its_connection_is_dropped(nursery: trio.Nursery) -> None:
    async def reply(request: h11.Request, body: bytes) -> tuple[int, bytes, After]:
        return 200, b"x" * (2 << 20) if body == b"big" else b"{}", "keep"

    server, url = await serving(nursery, reply, "/v3/kv/range")
    client = EtcdHttp(timeout=BOUND_S)
    with trio.fail_after(BOUND_S):
        with pytest.raises(CallFailed, match="over"):
            await client.post(url, b"big")
        assert await client.post(url, b"{}") == (200, b"{}")
        await client.aclose()
    assert server.connections == 2


async def test_https_endpoints_speak_tls_with_the_configured_trust(nursery: trio.Nursery) -> None:
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    server = Server(echo)
    await nursery.start(server.serve, server_context)
    url = f"https://127.0.0.1:{server.port}/v3/lease/grant"
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)
    with trio.fail_after(BOUND_S):
        client = EtcdHttp(timeout=BOUND_S, tls=trusting)
        assert await client.post(url, b"{}") == (200, b'{"echo":{}}')
        assert await client.post(url, b"{}") == (200, b'{"echo":{}}')
        await client.aclose()
        with pytest.raises(CallFailed):  # the system's trust does not know this CA
            await EtcdHttp(timeout=BOUND_S).post(url, b"{}")
    assert server.connections == 2

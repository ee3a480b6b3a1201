"""H11Transport: the Node's lean httpx transport (h11 over trio sockets, keep-alive pool).

Real sockets on 127.0.0.1 port 0: the mock backend, or a scripted raw HTTP/1.1
server (h11 on the server side) when a test needs the server to misbehave on cue.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

import attrs
import h11
import httpx
import pytest
import trio
import trio.testing

from iop_node import OpenAIAdapter, UpstreamFailed, UpstreamUnreachable
from iop_node.upstream.http11 import PostRequests, written
from iop_node.upstream.http_upstream import BodyStream, HttpUpstream
from iop_node.upstream.poller import BodyPoller, RunOutput
from iop_node.upstream.pool import H11Transport
from node.harness import Backend, openai_provider, read_request

CHAT = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
STREAM = {**CHAT, "max_tokens": 50, "stream": True}


def client_for(transport: H11Transport, port: int, **timeouts: float) -> httpx.AsyncClient:
    timeout = httpx.Timeout(timeouts.pop("default", 5.0), **timeouts)
    return httpx.AsyncClient(transport=transport, base_url=f"http://127.0.0.1:{port}", timeout=timeout)


# A scripted server: for the n-th request on the c-th connection, what to do.
#   "ok": answer 200 with a keep-alive body;  "ok-close": answer, then close the socket;
#   "drop": close without answering;  "hang": never answer (wait for the client to go);  "partial": half a body, then close.
Script = Callable[[int, int], str]


@attrs.define(eq=False)
class ScriptedServer:
    script: Script
    port: int = 0
    connections: int = 0
    requests: int = 0
    closed: trio.Event = attrs.field(factory=trio.Event)

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        index, self.connections = self.connections, self.connections + 1
        conn = h11.Connection(h11.SERVER)
        try:
            for n in range(1_000):
                if not await read_request(stream, conn):
                    return
                self.requests += 1
                action = self.script(index, n)
                if action == "hang":  # until the client goes
                    while await stream.receive_some(65536):
                        pass
                    return
                if action == "drop":
                    return
                body = b'{"ok":true}'
                if action == "partial":
                    head = h11.Response(status_code=200, headers=[("content-length", "100")])
                    await stream.send_all(conn.send(head) + conn.send(h11.Data(data=body)))
                    return
                head = h11.Response(status_code=200, headers=[("content-length", str(len(body)))])
                await stream.send_all(conn.send(head) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
                if action == "ok-close":
                    return
                conn.start_next_cycle()
        finally:
            await stream.aclose()
            self.closed.set()


async def scripted(nursery: trio.Nursery, script: Script) -> ScriptedServer:
    server = ScriptedServer(script)
    await nursery.start(server.serve)
    return server


async def test_keep_alive_connection_is_reused(backend: Backend) -> None:
    """Sequential requests share one connection; the whole body is read each time."""
    transport = H11Transport(4)
    with trio.fail_after(10):
        async with client_for(transport, backend.port) as client:
            for _ in range(3):
                response = await client.post("/v1/chat/completions", json=CHAT)
                assert response.status_code == 200
                assert response.json()["object"] == "chat.completion"
            assert (transport.opened, transport.open_connections) == (1, 1)
    assert backend.backend.stats()["total"] == 3
    assert transport.open_connections == 0  # the client closed it


def test_post_requests_are_the_bytes_h11_writes() -> None:
    """After h11 wrote the first request, later ones take its head with their own content-length:
    byte for byte what h11 writes, for any body length (none too)."""
    url = httpx.URL("http://127.0.0.1:9100/v1/chat/completions")
    posts = PostRequests(url, b"application/json")
    for body in (b'{"a":1}', b"", b"x" * 100_000, b'{"b":"\xc3\xa9"}'):
        headers = [(b"host", b"127.0.0.1:9100"), (b"content-type", b"application/json")]
        expected = written(b"POST", url, [*headers, (b"content-length", b"%d" % len(body))], body)
        assert posts.written(body) == expected


async def test_posts_on_a_reused_connection_carry_their_own_bodies(backend: Backend) -> None:
    """Requests written from the remembered head reach the backend whole, each with its body."""
    transport = H11Transport(1)
    posts = PostRequests(httpx.URL(f"http://127.0.0.1:{backend.port}/v1/chat/completions"), b"application/json")
    with trio.fail_after(10):
        for tokens in (3, 12, 7):
            answer = await transport.post(posts, json.dumps({**CHAT, "max_tokens": tokens}).encode(), {"read": 5})
            assert answer.status == 200
            body = b""
            while (chunk := await answer.next_chunk()) is not None:
                body += chunk
            assert json.loads(body)["usage"]["completion_tokens"] == tokens
        assert (transport.opened, transport.open_connections) == (1, 1)
        await transport.aclose()
    assert backend.backend.stats()["total"] == 3


async def test_stream_is_relayed_chunk_by_chunk(backend: Backend) -> None:
    """A slow SSE stream: the first event is readable before the rest is generated."""
    backend.backend.tokens_per_second = 20.0
    transport = H11Transport(1)
    with trio.fail_after(10):
        async with client_for(transport, backend.port) as client:
            async with client.stream("POST", "/v1/chat/completions", json=STREAM) as response:
                async with aclosing(BodyStream(response, raw=True)) as body:
                    first = await body.next_chunk()
                    assert first is not None and first.startswith(b"data: ")
                    assert backend.backend.stats()["in_flight"] == 1  # still generating
                    rest = b""
                    while (chunk := await body.next_chunk()) is not None:
                        rest += chunk
            assert (first + rest).endswith(b"data: [DONE]\n\n")
            assert transport.open_connections == 1  # read to the end: kept


@pytest.mark.req("tunnel-guard")
async def test_pool_is_bounded_by_capacity(backend: Backend, nursery: trio.Nursery) -> None:
    """[tunnel-guard] At most ``capacity`` connections: a third request waits for a free one."""
    backend.backend.tokens_per_second = 1.0  # the held streams stay in flight
    transport = H11Transport(2)
    results: list[int] = []
    async with client_for(transport, backend.port) as client:

        async def hold(scope: trio.CancelScope, task_status: trio.TaskStatus[None]) -> None:
            with scope:
                async with client.stream("POST", "/v1/chat/completions", json=STREAM):
                    task_status.started()
                    await trio.sleep_forever()

        async def whole() -> None:
            results.append((await client.post("/v1/chat/completions", json=CHAT)).status_code)

        with trio.fail_after(10):
            holders = [trio.CancelScope(), trio.CancelScope()]
            async with trio.open_nursery() as inner:
                for scope in holders:
                    await inner.start(hold, scope)
                inner.start_soon(whole)
                inner.start_soon(whole)
                await trio.testing.wait_all_tasks_blocked()
                assert transport.waiting == 2
                assert transport.open_connections == 2
                assert backend.backend.stats()["in_flight"] == 2
                backend.backend.tokens_per_second = 0.0
                for scope in holders:
                    scope.cancel()
            assert results == [200, 200]
            assert backend.backend.stats()["peak_in_flight"] == 2
            assert transport.open_connections <= 2
            await backend.wait_idle()


@pytest.mark.req("runtime-concurrency")
async def test_cancel_mid_body_discards_the_connection(backend: Backend) -> None:
    """[runtime-concurrency] Leaving a stream half-read closes its connection: the backend
    sees the client go (in_flight back to 0) and the connection is never reused."""
    backend.backend.tokens_per_second = 5.0
    transport = H11Transport(2)
    with trio.fail_after(10):
        async with client_for(transport, backend.port) as client:
            with trio.CancelScope() as scope:
                async with client.stream("POST", "/v1/chat/completions", json=STREAM) as response:
                    async with aclosing(BodyStream(response, raw=True)) as body:
                        assert await body.next_chunk()
                        scope.cancel()
                        await trio.sleep_forever()
            assert scope.cancelled_caught
            assert transport.open_connections == 0
            await backend.wait_idle()
            backend.backend.tokens_per_second = 0.0
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            assert transport.opened == 2


async def test_server_closed_idle_connection_reconnects(nursery: trio.Nursery) -> None:
    """The server answers and closes a keep-alive connection: the next request opens a new one."""
    server = await scripted(nursery, lambda c, n: "ok-close")
    transport = H11Transport(2)
    with trio.fail_after(10):
        async with client_for(transport, server.port) as client:
            assert (await client.get("/")).status_code == 200
            await server.closed.wait()
            assert (await client.get("/")).status_code == 200
    assert (transport.opened, server.connections, server.requests) == (2, 2, 2)


async def test_reused_connection_dropped_before_answer_is_retried_once(nursery: trio.Nursery) -> None:
    """The server closes a reused connection on receiving the request, unanswered: the
    request is sent again on a fresh connection (the server had dropped it unseen)."""
    server = await scripted(nursery, lambda c, n: "drop" if (c, n) == (0, 1) else "ok")
    transport = H11Transport(2)
    with trio.fail_after(10):
        async with client_for(transport, server.port) as client:
            assert (await client.post("/", content=b"one")).status_code == 200
            assert (await client.post("/", content=b"two")).status_code == 200
    assert (transport.opened, server.requests) == (2, 3)


@pytest.mark.parametrize("action", ["drop", "partial"])
async def test_connection_closed_mid_answer_is_an_error(nursery: trio.Nursery, action: str) -> None:
    """A new connection closed before the answer ("drop": not retried) or in the middle of
    its body ("partial"): RemoteProtocolError, the connection gone, the slot free."""
    server = await scripted(nursery, lambda c, n: action)
    transport = H11Transport(1)
    with trio.fail_after(10):
        async with client_for(transport, server.port) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                await client.post("/", content=b"x")
    assert (transport.opened, transport.open_connections, transport.waiting) == (1, 0, 0)
    assert server.requests == 1


async def test_read_timeout(nursery: trio.Nursery) -> None:
    """No answer within the read timeout: httpx.ReadTimeout; the connection is closed."""
    server = await scripted(nursery, lambda c, n: "hang")
    transport = H11Transport(1)
    with trio.fail_after(10):
        async with client_for(transport, server.port, read=0.05) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.get("/")
            assert transport.open_connections == 0
            await server.closed.wait()  # the server saw the connection go


async def test_pool_timeout(nursery: trio.Nursery) -> None:
    """Every connection busy past the pool timeout: httpx.PoolTimeout."""
    server = await scripted(nursery, lambda c, n: "hang")
    transport = H11Transport(1)
    with trio.fail_after(10):
        async with client_for(transport, server.port, pool=0.05) as client:
            async with trio.open_nursery() as inner:
                inner.start_soon(client.get, "/")
                await trio.testing.wait_all_tasks_blocked()
                with pytest.raises(httpx.PoolTimeout):
                    await client.get("/")
                inner.cancel_scope.cancel()
            assert transport.open_connections == 0


async def test_connect_timeout(monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock) -> None:
    """Connecting takes longer than the connect timeout: httpx.ConnectTimeout, slot returned."""

    async def never_connects(*args: Any, **kwargs: Any) -> trio.SocketStream:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    monkeypatch.setattr(trio, "open_tcp_stream", never_connects)
    transport = H11Transport(1)
    async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(30, connect=2)) as client:
        with pytest.raises(httpx.ConnectTimeout):
            await client.get("http://upstream.test/")
    assert trio.current_time() == 2
    assert (transport.open_connections, transport.waiting) == (0, 0)


async def test_connect_timeout_to_an_ip_address(autojump_clock: trio.testing.MockClock) -> None:
    """An IP address is connected without trio.open_tcp_stream; a connect still pending at the
    connect timeout (the listener's accept queue is full, so the kernel drops our SYN) is
    httpx.ConnectTimeout, and its socket is closed."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = [socket.socket() for _ in range(3)]
        for filler in fillers:
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
        transport = H11Transport(1)
        try:
            async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(30, connect=2)) as client:
                with pytest.raises(httpx.ConnectTimeout):
                    await client.get(f"http://127.0.0.1:{port}/")
        finally:
            for filler in fillers:
                filler.close()
    assert trio.current_time() == 2
    assert (transport.open_connections, transport.waiting, transport.opened) == (0, 0, 0)


async def test_connection_refused_is_upstream_unreachable() -> None:
    """Nothing listens on the port: the adapter raises UpstreamUnreachable (upstream_unreachable)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    adapter = OpenAIAdapter.from_config(openai_provider(port))
    assert isinstance(adapter.http.client._transport, H11Transport)
    with trio.fail_after(10), pytest.raises(UpstreamUnreachable) as caught:
        async with aclosing(adapter.run("chat/completions", CHAT, stream=False)) as run:
            async for _ in run:
                pass
    assert caught.value.code == "upstream_unreachable"
    await adapter.aclose()


async def test_relay_maps_what_goes_wrong(backend: Backend, nursery: trio.Nursery) -> None:
    """A run's relay straight to H11Transport: a refused connection and a silent upstream are
    UpstreamUnreachable, a 4xx is UpstreamFailed with its status and body; each returns its slot."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        refused_port = probe.getsockname()[1]
    silent = await scripted(nursery, lambda connection, n: "hang")
    chunks: list[bytes] = []

    async def send(chunk: bytes) -> None:
        chunks.append(chunk)
        await trio.lowlevel.checkpoint()

    async def relay(port: int, body: dict[str, Any], *, kept: int = 0) -> Exception:
        adapter = OpenAIAdapter.from_config(openai_provider(port, timeout_ms=200))
        transport = adapter.http.direct
        assert transport is not None
        for _ in range(2):  # the second one needs the slot (capacity 1) the first returned
            with pytest.raises((UpstreamUnreachable, UpstreamFailed)) as caught:
                await adapter.relay("chat/completions", body, stream=False, send=send)
            assert (transport.open_connections, transport.waiting) == (kept, 0)
        await adapter.aclose()
        return caught.value

    with trio.fail_after(10):
        refused = await relay(refused_port, CHAT)
        assert isinstance(refused, UpstreamUnreachable) and "unreachable" in refused.message
        timed_out = await relay(silent.port, CHAT)
        assert isinstance(timed_out, UpstreamUnreachable) and "timed out" in timed_out.message
        failed = await relay(backend.port, {**CHAT, "max_tokens": 100_000}, kept=1)  # read to its end: kept
        assert isinstance(failed, UpstreamFailed) and failed.status == 400
        assert failed.body is not None and "maximum" in json.loads(failed.body)["error"]["message"]
    assert chunks == []


def test_https_uses_httpx_default_transport() -> None:
    """https:// upstreams keep httpx's own transport (TLS); http:// ones get H11Transport."""
    provider = attrs.evolve(openai_provider(1), base_url="https://gpu.example/v1")
    upstream = HttpUpstream.for_provider(provider, "https://gpu.example")
    assert isinstance(upstream.client._transport, httpx.AsyncHTTPTransport)


async def test_https_url_is_refused_by_h11_transport() -> None:
    """H11Transport serves plain http:// only."""
    async with httpx.AsyncClient(transport=H11Transport(1)) as client:
        with pytest.raises(httpx.UnsupportedProtocol):
            await client.get("https://upstream.test/")


async def test_upstream_cookies_are_not_kept() -> None:
    """A cookie set by the upstream for one run is not sent with the next (one client
    carries every Edge client's runs)."""
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("cookie"))
        return httpx.Response(200, json={"choices": []}, headers={"set-cookie": "session=alice; Path=/"})

    provider = openai_provider(1)
    upstream = HttpUpstream.for_provider(provider, "http://upstream.test", transport=httpx.MockTransport(handler))
    for _ in range(2):
        async with upstream.post_json("http://upstream.test/v1/chat/completions", CHAT) as response:
            assert response.status_code == 200
    assert seen == [None, None]
    await upstream.aclose()


async def test_pump_read_timeout_counts_only_upstream_silence(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """Answer.pump: time spent in ``send`` (a full outbox) is not upstream silence, a piece
    cut off by the timeout scope is sent again whole, and only a wait for the upstream
    longer than the read timeout is httpx.ReadTimeout (exactly the timeout after it began)."""
    client_sock, server_sock = socket.socketpair()

    async def connect(*args: Any, **kwargs: Any) -> trio.SocketStream:
        return trio.SocketStream(trio.socket.from_stdlib_socket(client_sock))

    monkeypatch.setattr(trio, "open_tcp_stream", connect)

    async def upstream() -> None:
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(server_sock))
        await read_request(stream, conn := h11.Connection(h11.SERVER))
        head = h11.Response(status_code=200, headers=[("transfer-encoding", "chunked")])
        await stream.send_all(conn.send(head) + conn.send(h11.Data(data=b"one")))
        await trio.sleep(10)
        await stream.send_all(conn.send(h11.Data(data=b"two")))
        await trio.sleep_forever()

    received: list[tuple[float, bytes]] = []

    async def send(chunk: bytes) -> None:
        await trio.sleep_until(20)  # the Edge reads nothing until t=20
        received.append((trio.current_time(), chunk))

    transport = H11Transport(1)
    url = httpx.URL("http://upstream.test/v1/chat/completions")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(upstream)
        answer = await transport.request(b"POST", url, [(b"host", b"upstream.test")], b"", {"read": 5})
        with pytest.raises(httpx.ReadTimeout):
            await answer.pump(send)
        assert trio.current_time() == 25
        assert received == [(20, b"one"), (20, b"two")]
        assert (transport.open_connections, transport.waiting) == (0, 0)
        nursery.cancel_scope.cancel()
    server_sock.close()


@pytest.mark.req("runtime-concurrency")
@pytest.mark.parametrize("reader", ["pump", "poller"])
async def test_run_cancelled_mid_body_returns_the_slot_once(backend: Backend, reader: str) -> None:
    """[runtime-concurrency] A run cancelled while its body is being read (by Answer.pump in
    the run task, or by the session's BodyPoller) when the Edge cancels it stops the reading,
    closes its connection at once (the backend sees the client go) and returns its pool slot
    exactly once: with capacity 1 the next request gets the slot and the one after it times
    out waiting (a slot returned twice would let both in)."""
    backend.backend.tokens_per_second = 5.0
    transport = H11Transport(1)
    url = httpx.URL(f"http://127.0.0.1:{backend.port}/v1/chat/completions")
    body = json.dumps(STREAM).encode()
    headers = [(b"host", url.netloc), (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    timeouts = {"read": 5.0, "pool": 0.05}
    first = trio.Event()
    poller = BodyPoller()

    async def send(chunk: bytes) -> None:
        first.set()
        await trio.lowlevel.checkpoint()

    async def no_wait() -> bool:
        return False

    async def run() -> None:  # as HttpUpstream.relay_post: the reading and its finally both give back
        answer = await transport.request(b"POST", url, headers, body, timeouts)
        try:
            if reader == "pump":
                await answer.pump(send)
            else:
                await poller.relay(answer, RunOutput(send, lambda chunk: first.set(), poller))
        finally:
            answer.close()

    with trio.fail_after(10):
        async with trio.open_nursery() as runs:
            runs.start_soon(poller.serve, no_wait)
            runs.start_soon(run)
            await first.wait()
            runs.cancel_scope.cancel()
        assert (transport.open_connections, transport.waiting, poller.reading) == (0, 0, 0)
        await backend.wait_idle()
        backend.backend.tokens_per_second = 0.0
        second = await transport.request(b"POST", url, headers, body, timeouts)
        with pytest.raises(httpx.PoolTimeout):
            await transport.request(b"POST", url, headers, body, timeouts)
        second.close()
    assert transport.opened == 2

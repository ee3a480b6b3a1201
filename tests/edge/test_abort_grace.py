"""A provider's capacity returns only when its backend let go of an aborted request ([cancel-upstream]).

An in-process Edge, a real Node (``openai`` adapter, ``gpu0`` of capacity 1) and a
:class:`LateBackend` on loopback sockets: a backend that reads the end of a connection whose
request it works on, but notices it (stops counting the request) only when the test says so, the
way a busy server polls for disconnects between steps. Meanwhile it reads and counts any request
that reaches it: were the Node to return its permit when it closes the connection, the request
queued behind would run beside the one the backend still holds.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import h11
import httpx
import pytest
import trio
import trio.testing

from edge.harness import BIG, FAST, Edge, eventually, node_config, real_node, running_edge, start_chat
from iop_node import ProviderConfig

pytestmark = pytest.mark.req("cancel-upstream", "deadline")

_SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_EVENT = b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n'


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@attrs.define(eq=False)
class LateBackend:
    """An OpenAI-like backend that holds every request until :attr:`answering`, and notices a
    client's end only once :attr:`noticing` is set.

    Attributes:
        answering: from now on, requests are answered at once (and the connection closed).
        noticing: set: the ends of the connections it holds are noticed (the request let go).
        in_flight, peak, total: requests counted now, at most at once, in all.
        ends_read: held connections whose end the backend has read (noticed or not).
        port: where it listens.
    """

    answering: bool = False
    noticing: trio.Event = attrs.field(factory=trio.Event)
    in_flight: int = 0
    peak: int = 0
    total: int = 0
    ends_read: int = 0
    port: int = 0

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            body = await _read_request(stream)
            if body is None:
                return
            streaming = bool(json.loads(body).get("stream"))
            self.in_flight += 1
            self.total += 1
            self.peak = max(self.peak, self.in_flight)
            try:
                if self.answering:
                    await stream.send_all(_answer(streaming))
                    return
                if streaming:  # a stream under way: its head and a first token
                    await stream.send_all(_SSE_HEAD + _chunk(_EVENT))
                await _read_end(stream)
                self.ends_read += 1
                await self.noticing.wait()
            finally:
                self.in_flight -= 1


async def _read_request(stream: trio.SocketStream) -> bytes | None:
    reader = h11.Connection(h11.SERVER)
    body = b""
    while True:
        event = reader.next_event()
        if event is h11.NEED_DATA:
            reader.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return body
        elif isinstance(event, h11.ConnectionClosed):
            return None


async def _read_end(stream: trio.SocketStream) -> None:
    try:
        while await stream.receive_some(65536):
            pass
    except trio.BrokenResourceError:  # a reset
        pass


def _answer(streaming: bool) -> bytes:
    if streaming:
        return _SSE_HEAD + _chunk(_EVENT) + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    body = json.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "mock",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}],
        }
    ).encode()
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
    return head % len(body) + body


@asynccontextmanager
async def _stack(tmp_path: Path, backend: LateBackend, grace_ms: int = 1_500) -> AsyncIterator[Edge]:
    """An Edge and a Node whose ``gpu0`` (capacity 1, ``abort_grace_ms``) is ``backend``."""
    async with trio.open_nursery() as outer:
        port = await outer.start(backend.serve)
        async with running_edge(tmp_path) as edge:
            gpu0 = ProviderConfig(
                id="gpu0", adapter="openai", capacity=1, base_url=f"http://127.0.0.1:{port}/v1", abort_grace_ms=grace_ms
            )
            async with real_node(edge, node_config(edge, "node-a", [gpu0])):
                yield edge
        outer.cancel_scope.cancel()


async def _queue_behind(
    edge: Edge, backend: LateBackend, waiter: trio.Nursery, results: dict[str, httpx.Response]
) -> None:
    """Once the backend holds a request: queue the next one at the Edge; the backend answers it at once."""
    await eventually(lambda: backend.in_flight == 1)
    start_chat(waiter, edge, results, "next", FAST, max_tokens=1)
    await eventually(lambda: edge.queue_depth == 1)
    backend.answering = True


async def _held_until_let_go(edge: Edge, backend: LateBackend) -> None:
    """The backend read the aborted request's end but holds it: nothing else reaches it until it lets go."""
    await eventually(lambda: backend.ends_read == 1)
    await trio.testing.wait_all_tasks_blocked(0.05)  # a permit returned now would send the next request
    assert (backend.total, backend.in_flight, edge.queue_depth) == (1, 1, 1)
    backend.noticing.set()


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_a_client_gone_holds_the_capacity_until_the_backend_lets_go(tmp_path: Path, stream: bool) -> None:
    """[cancel-upstream] a client hangs up while the backend works on its request: the Node ends the
    connection, and the request queued behind reaches the backend only once the backend let go of the
    first (it notices late): never two at once on a provider of capacity 1."""
    backend = LateBackend()
    with trio.fail_after(20):
        async with _stack(tmp_path, backend) as edge:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as waiter:
                async with trio.open_nursery() as client:
                    start_chat(client, edge, {}, "hangs up", BIG, stream=stream, max_tokens=1000)
                    await _queue_behind(edge, backend, waiter, results)
                    client.cancel_scope.cancel()
                await _held_until_let_go(edge, backend)
            assert results["next"].status_code == 200, results["next"].text
            assert (backend.peak, backend.total, backend.in_flight) == (1, 2, 0)
            await edge.assert_drained()


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_the_deadline_is_answered_at_once_and_holds_the_capacity_until_the_backend_lets_go(
    tmp_path: Path, stream: bool
) -> None:
    """[deadline] [cancel-upstream] a request's deadline passes while the backend works on it: the
    client has its 504 (or its stream's final error) while the backend still holds the request, and
    the request queued behind reaches the backend only once the backend let go."""
    backend = LateBackend()
    with trio.fail_after(20):
        async with _stack(tmp_path, backend) as edge:
            results: dict[str, httpx.Response] = {}
            timed = {"model": BIG, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1000, "stream": stream}
            async with trio.open_nursery() as waiter:

                async def timed_out() -> None:
                    results["timed"] = await edge.http.post(
                        "/v1/chat/completions", json=timed, headers={"X-Request-Timeout": "0.5"}
                    )

                waiter.start_soon(timed_out)
                await _queue_behind(edge, backend, waiter, results)
                await eventually(lambda: "timed" in results)
                assert (backend.in_flight, backend.ends_read) == (1, 1)  # answered before the backend let go
                await _held_until_let_go(edge, backend)
            answer = results["timed"]
            if stream:
                assert answer.status_code == 200 and '"code":"deadline_exceeded"' in answer.text, answer.text
            else:
                assert answer.status_code == 504, answer.text
                assert answer.headers["x-iop-error-class"] == "deadline_exceeded"
            assert results["next"].status_code == 200, results["next"].text
            assert (backend.peak, backend.total, backend.in_flight) == (1, 2, 0)
            failures = (await edge.status())["failures"][BIG]
            assert failures == {"deadline_exceeded": 1}
            await edge.assert_drained()


async def test_a_backend_that_never_lets_go_gets_its_capacity_back_after_the_grace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """[cancel-upstream] a backend that does not let go within ``abort_grace_ms``: the capacity returns
    then, the next request runs (beside the one the backend still holds), and the Node says so."""
    backend = LateBackend()
    with trio.fail_after(20), caplog.at_level(logging.WARNING, logger="iop_node"):
        async with _stack(tmp_path, backend, grace_ms=100) as edge:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as waiter:
                async with trio.open_nursery() as client:
                    start_chat(client, edge, {}, "hangs up", BIG, max_tokens=1000)
                    await _queue_behind(edge, backend, waiter, results)
                    client.cancel_scope.cancel()
            assert results["next"].status_code == 200, results["next"].text
            assert (backend.peak, backend.total, backend.in_flight) == (2, 2, 1)
            assert any("did not let go of an aborted request" in r.getMessage() for r in caplog.records)
            backend.noticing.set()
            await eventually(lambda: backend.in_flight == 0)
            await edge.assert_drained()

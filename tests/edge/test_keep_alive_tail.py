"""A keep-alive connection is not held by the tail of its previous request ([deadline]).

A request answered at its deadline keeps its lease until the node confirms the run let go
(``RequestDeadline.answer_now``); meanwhile its connection reads and answers the client's next
request. One client on one TCP connection (``h11`` as its framing), an in-process Edge, a fake
node that holds the cancelled run's end until the test sends it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h11
import pytest
import trio
import trio.testing

from edge.harness import BIG, Edge, chat_chunk, eventually, fake_node, running_edge, sse_events
from iop_edge.listener.asgi import CONNECTION
from iop_edge.listener.server import ConnectionCounter, HttpLimits, serve_http
from iop_edge.nodes import runs
from iop_wire import RunEnd

pytestmark = pytest.mark.req("deadline")


class KeepAliveClient:
    """One HTTP/1.1 connection to the Edge: requests one after another, each answer read whole."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    async def request(self, method: str, target: str, body: bytes = b"", **headers: str) -> tuple[int, bytes]:
        """Send one request, read its whole answer (status, body); the connection stays open."""
        if self.h11.our_state is h11.DONE:
            self.h11.start_next_cycle()
        fields = [("host", "edge"), ("content-length", str(len(body))), *headers.items()]
        await self.stream.send_all(self.h11.send(h11.Request(method=method, target=target, headers=fields)))
        await self.stream.send_all(self.h11.send(h11.Data(data=body)) + self.h11.send(h11.EndOfMessage()))
        status, answer = 0, b""
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await self.stream.receive_some())
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                answer += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert self.h11.their_state is h11.DONE  # keep-alive: the Edge did not say close
                return status, answer
            else:
                raise AssertionError(event)


def _chat(stream: bool) -> bytes:
    fields = {"model": BIG, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1000, "stream": stream}
    return json.dumps(fields).encode()


def _tails(edge: Edge) -> int:
    return edge.service.front_door.connections.tails


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_the_next_request_is_answered_while_the_previous_one_waits_for_its_run_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """[deadline] the first request's deadline passes while the node works on its run: its 504 (a
    stream: its final error event) comes at once, and the same connection's next request is answered while the node still holds the run (the
    first lease still counted in ``in_flight``); once the node ends the run the lease is released, the
    tail wrote nothing more on the connection, and the connection serves on."""
    monkeypatch.setattr(runs, "CANCEL_SETTLE_TIMEOUT", 60.0)  # the tail waits for the node, however slow the box
    with trio.fail_after(30):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            connection = await trio.open_tcp_stream("127.0.0.1", edge.http_port)
            async with connection, trio.open_nursery() as nursery:
                client = KeepAliveClient(connection)
                first: list[tuple[int, bytes]] = []

                async def timed_out() -> None:
                    first.append(await client.request("POST", "/v1/chat/completions", _chat(stream), **_timeout(0.3)))

                nursery.start_soon(timed_out)
                run = await node.next_run()
                if stream:
                    await node.send_json(run.run_id, chat_chunk("first"))
                assert (await node.next_cancel()).run_id == run.run_id
                await eventually(lambda: bool(first))  # the answer comes without the node's end
                status, body = first[0]
                if stream:
                    assert status == 200 and sse_events(body.decode())[-1]["error"]["code"] == "deadline_exceeded"
                else:
                    assert status == 504 and json.loads(body)["error"]["code"] == "deadline_exceeded", body
                assert await client.request("GET", "/v1/models") == (200, await _models(edge))
                assert edge.provider("node-a", "gpu0")["in_flight"] == 1  # the first lease: not yet let go
                assert _tails(edge) == 1
                await node.send(RunEnd(run.run_id, "cancelled", "cancelled"))
                await eventually(lambda: edge.provider("node-a", "gpu0")["in_flight"] == _tails(edge) == 0)
                # Nothing of the tail reached the socket: the next answer is framed right behind the last.
                assert await client.request("GET", "/v1/models") == (200, await _models(edge))
            await edge.assert_drained()


def _timeout(seconds: float) -> dict[str, str]:
    return {"x-request-timeout": str(seconds)}


async def _models(edge: Edge) -> bytes:
    return (await edge.http.get("/v1/models")).content


# ------------------------------------------------------------------ the listener on its own


class TailApp:
    """An ASGI app whose ``/tail`` requests answer, ask ``serve_next_meanwhile`` and wait for
    :attr:`release` (their tail), then try to write more; other paths answer at once."""

    def __init__(self) -> None:
        self.release = trio.Event()
        self.handed: list[bool] = []
        self.cancelled = 0
        self.seen: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.seen.append(scope["path"])
        await receive()
        body = scope["path"].encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})
        if scope["path"] != "/tail":
            return
        self.handed.append(scope["extensions"][CONNECTION].serve_next_meanwhile())
        try:
            await self.release.wait()
        except trio.Cancelled:
            self.cancelled += 1
            raise
        await send({"type": "http.response.body", "body": b"too late"})  # the response is complete: dropped


async def _a_tail_and_a_next_answer(nursery: trio.Nursery, app: TailApp, counter: ConnectionCounter) -> KeepAliveClient:
    """A listener serving ``app``, and a client on it whose ``/tail`` runs its tail while ``/a`` was answered."""
    port: int = await nursery.start(
        lambda task_status: serve_http(
            app, "127.0.0.1", 0, limits=HttpLimits(header_timeout=5), counter=counter, task_status=task_status
        )  # type: ignore[arg-type]
    )
    client = KeepAliveClient(await trio.open_tcp_stream("127.0.0.1", port))
    assert await client.request("GET", "/tail") == (200, b"/tail")
    assert await client.request("GET", "/a") == (200, b"/a")  # answered while the tail waits
    assert (app.handed, counter.tails) == ([True], 1)
    return client


async def test_one_tail_at_a_time_and_the_answers_in_order() -> None:
    """A tail runs while the next request is answered; a second tail is not handed over while the first
    runs (its own next request waits for it); nothing a tail writes reaches the connection."""
    app, counter = TailApp(), ConnectionCounter(8)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            client = await _a_tail_and_a_next_answer(nursery, app, counter)
            async with client.stream:
                assert await client.request("GET", "/tail") == (200, b"/tail")
                assert (app.handed, counter.tails) == ([True, False], 1)  # one tail per connection
                waiting: list[tuple[int, bytes]] = []

                async def behind_the_second_tail() -> None:
                    waiting.append(await client.request("GET", "/b"))

                nursery.start_soon(behind_the_second_tail)
                await trio.testing.wait_all_tasks_blocked(0.05)  # a connection reading now would have /b
                assert (waiting, app.seen[-1]) == ([], "/tail")  # not read while the second tail runs inline
                app.release.set()
                await eventually(lambda: bool(waiting))
                assert waiting == [(200, b"/b")] and counter.tails == 0
                assert await client.request("GET", "/c") == (200, b"/c")  # no stray bytes before it
                assert app.cancelled == 0
                nursery.cancel_scope.cancel()


@pytest.mark.parametrize("ends", ["client", "listener"])
async def test_a_tail_is_cancelled_when_its_connection_ends(ends: str) -> None:
    """The client leaving (the connection ends) or the listener stopping cancels a running tail."""
    app, counter = TailApp(), ConnectionCounter(8)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            client = await _a_tail_and_a_next_answer(nursery, app, counter)
            async with client.stream:
                if ends == "client":
                    await client.stream.aclose()
                    await eventually(lambda: counter.open == 0)
                nursery.cancel_scope.cancel()
        assert (app.cancelled, counter.tails, counter.open) == (1, 0, 0)

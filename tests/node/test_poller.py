"""BodyPoller: one task reads the answer bodies of every run of a session.

Upstreams are socket pairs (the transport's connect is patched to hand out one
end, the test serves the other with h11) or the mock backend on 127.0.0.1 port 0.
"""

from __future__ import annotations

import socket
from typing import Any

import attrs
import h11
import httpx
import pytest
import trio
import trio.testing

from iop_node.upstream.poller import TICK, BodyPoller, RunOutput
from iop_node.upstream.pool import H11Transport

URL = httpx.URL("http://upstream.test/v1/chat/completions")
HEADERS = [(b"host", b"upstream.test")]


@attrs.define(eq=False)
class Collected:
    """A run's output: what was queued, and how (``await`` by the run task, ``nowait`` by the poller)."""

    chunks: list[tuple[str, bytes]] = attrs.field(factory=list)
    full: bool = False
    """Set by a queued chunk when ``fill`` is on: the outbox is then full until ``drain``."""
    fill: bool = False
    drained: trio.Event = attrs.field(factory=trio.Event)

    def output(self, poller: BodyPoller) -> RunOutput:
        async def put(chunk: bytes) -> None:
            self.chunks.append(("await", chunk))
            await trio.lowlevel.checkpoint()

        def put_nowait(chunk: bytes) -> None:
            self.chunks.append(("nowait", chunk))
            self.full = self.fill

        return RunOutput(put, put_nowait, poller)

    async def room(self) -> bool:
        if not self.full:
            return False
        await self.drained.wait()
        self.full = False
        return True

    @property
    def body(self) -> bytes:
        return b"".join(chunk for _, chunk in self.chunks)


def socket_upstreams(monkeypatch: pytest.MonkeyPatch, n: int) -> list[socket.socket]:
    """Patch the transport's connect to hand out socket pairs; return the server ends."""
    pairs = [socket.socketpair() for _ in range(n)]
    clients = [client for client, _ in pairs]

    async def connect(*args: Any, **kwargs: Any) -> trio.SocketStream:
        return trio.SocketStream(trio.socket.from_stdlib_socket(clients.pop(0)))

    monkeypatch.setattr(trio, "open_tcp_stream", connect)
    return [server for _, server in pairs]


async def serve_chunks(sock: socket.socket, script: list[float | bytes], *, end: bool = True) -> None:
    """Answer one request with a chunked body: bytes are sent as one chunk, a float sleeps."""
    async with trio.SocketStream(trio.socket.from_stdlib_socket(sock)) as stream:
        await _serve_chunks(stream, script, end=end)


async def _serve_chunks(stream: trio.SocketStream, script: list[float | bytes], *, end: bool) -> None:
    conn = h11.Connection(h11.SERVER)
    while type(event := conn.next_event()) is not h11.EndOfMessage:
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
    head = h11.Response(status_code=200, headers=[("transfer-encoding", "chunked")])
    await stream.send_all(conn.send(head) or b"")
    for step in script:
        if isinstance(step, float):
            await trio.sleep(step)
        else:
            await stream.send_all(conn.send(h11.Data(data=step)) or b"")
    if end:
        await stream.send_all(conn.send(h11.EndOfMessage()) or b"")
        await trio.sleep_forever()  # keep-alive: the client keeps the connection
    # else: mid-body, the connection closes


@pytest.mark.req("relay-fidelity")
async def test_poller_relays_every_body_exactly_in_order(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """[relay-fidelity] Three answers read by one poller: each run gets exactly its
    upstream's bytes in order (a multi-byte character split across chunks included),
    the poller queues them without waiting, and each connection goes back to the pool."""
    scripts: list[list[float | bytes]] = [
        [0.01, b"data: a\n\n", 0.05, b"data: \xc3", 0.001, b"\xa9\r\n\r\n", b"data: [DONE]\n\n"],
        [0.02, b": comment\n", 0.03, b"data: b1\ndata: b2\n\n", 0.1, b"data: [DONE]\n\n"],
        [0.5, b"data: c\n\n"],
    ]
    servers = socket_upstreams(monkeypatch, len(scripts))
    transport = H11Transport(3)
    poller = BodyPoller()
    outputs = [Collected() for _ in scripts]

    async def run(i: int) -> None:
        answer = await transport.request(b"POST", URL, HEADERS, b"", {"read": 5})
        await poller.relay(answer, outputs[i].output(poller))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.serve, outputs[0].room)
        for server, script in zip(servers, scripts, strict=True):
            nursery.start_soon(serve_chunks, server, script)
        async with trio.open_nursery() as runs:
            for i in range(len(scripts)):
                runs.start_soon(run, i)
        assert poller.reading == 0
        assert (transport.open_connections, transport.waiting) == (3, 0)
        nursery.cancel_scope.cancel()
    await transport.aclose()
    # (which run got which socket pair depends on the order the runs connected in)
    expected = sorted(b"".join(step for step in script if isinstance(step, bytes)) for script in scripts)
    assert sorted(output.body for output in outputs) == expected
    assert {how for output in outputs for how, _ in output.chunks} == {"nowait"}


@pytest.mark.parametrize(("upstreams", "pieces"), [(1, [b"1", b"2", b"3", b"4", b"5"]), (3, [b"1", b"234", b"5"])])
async def test_poller_reads_at_most_once_a_tick_while_busy(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock, upstreams: int, pieces: list[bytes]
) -> None:
    """Reading several bodies, chunks that arrive within one tick of the previous read are
    read together, one tick after it: one queued piece per tick, not one per upstream
    write (the poller sleeps out the tick and then looks); a chunk after a quiet spell
    is read at once. Reading one body only, every chunk is read at once (a lone
    request's answer is never held back)."""
    step = TICK / 4
    script: list[float | bytes] = [0.1, b"1", step, b"2", step, b"3", step, b"4", 1.0, b"5"]
    servers = socket_upstreams(monkeypatch, upstreams)
    transport = H11Transport(upstreams)
    poller = BodyPoller()
    outputs = [Collected() for _ in servers]

    async def run(output: Collected) -> None:
        answer = await transport.request(b"POST", URL, HEADERS, b"", {"read": 5})
        await poller.relay(answer, output.output(poller))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.serve, outputs[0].room)
        for server in servers:
            nursery.start_soon(serve_chunks, server, script)
        async with trio.open_nursery() as runs:
            for output in outputs:
                runs.start_soon(run, output)
        nursery.cancel_scope.cancel()
    await transport.aclose()
    for output in outputs:
        assert [chunk for _, chunk in output.chunks] == pieces


async def relay_one(
    monkeypatch: pytest.MonkeyPatch, script: list[float | bytes], output: Collected, *, end: bool = True
) -> None:
    """One run through a fresh transport and poller, its upstream serving ``script``; afterwards
    (whatever it raised) nothing is being read and the run's slot and connection are given back."""
    [server] = socket_upstreams(monkeypatch, 1)
    transport = H11Transport(1)
    poller = BodyPoller()
    failure: Exception | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.serve, output.room)
        nursery.start_soon(lambda: serve_chunks(server, script, end=end))
        answer = await transport.request(b"POST", URL, HEADERS, b"", {"read": 5})
        try:
            await poller.relay(answer, output.output(poller))
        except Exception as exc:  # raised below, outside the nursery (no ExceptionGroup)
            failure = exc
        assert (poller.reading, transport.waiting) == (0, 0)
        nursery.cancel_scope.cancel()
    await transport.aclose()
    if failure is not None:
        raise failure


async def test_poller_read_timeout_counts_only_upstream_silence(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """While the poller waits for room in the outbox (until t=20) a run's upstream is not
    silent; after that, silence longer than the read timeout fails the run with
    httpx.ReadTimeout exactly the timeout after the poller resumed."""
    output = Collected(fill=True)

    async def drain_at_20() -> None:
        await trio.sleep_until(20)
        output.drained.set()

    nursery.start_soon(drain_at_20)
    with pytest.raises(httpx.ReadTimeout):
        await relay_one(monkeypatch, [1.0, b"one", 100.0, b"two"], output)
    assert trio.current_time() == 25
    assert output.chunks == [("nowait", b"one")]


async def test_body_closed_mid_way_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """The upstream closes the connection in the middle of a chunked body: the run fails
    with httpx.RemoteProtocolError after the bytes that did arrive."""
    output = Collected()
    with pytest.raises(httpx.RemoteProtocolError):
        await relay_one(monkeypatch, [0.1, b"data: a\n\n", 0.1], output, end=False)
    assert output.body == b"data: a\n\n"


async def test_runs_fail_when_the_poller_ends(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """A poller that stops (its session ends) fails every body it was reading with
    trio.BrokenResourceError, and a later run cannot register with it."""
    [server] = socket_upstreams(monkeypatch, 1)
    transport = H11Transport(1)
    poller = BodyPoller()
    output = Collected()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_chunks, server, [0.1, b"a", 100.0, b"b"])
        async with trio.open_nursery() as serving:
            serving.start_soon(poller.serve, output.room)
            answer = await transport.request(b"POST", URL, HEADERS, b"", {"read": 500})
            with pytest.raises(trio.BrokenResourceError):
                async with trio.open_nursery() as runs:
                    runs.start_soon(poller.relay, answer, output.output(poller))
                    await trio.sleep(1)
                    serving.cancel_scope.cancel()
        assert output.body == b"a"
        assert (poller.reading, transport.open_connections, transport.waiting) == (0, 0, 0)
        nursery.cancel_scope.cancel()
    await transport.aclose()


async def test_poller_reads_a_new_body_at_once_within_a_tick(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """A body's first data (a non-stream answer whose head came alone) is read when it
    arrives, even within the tick after another body's read: only a body the poller
    reads already waits for the tick."""
    scripts: list[list[float | bytes]] = [[0.1, b"a1", 1.0, b"a2"], [0.1 + TICK / 4, b"b1"]]
    servers = socket_upstreams(monkeypatch, len(scripts))
    transport = H11Transport(len(scripts))
    poller = BodyPoller()
    read_at: dict[bytes, float] = {}
    start = trio.current_time()

    def output() -> RunOutput:
        async def put(chunk: bytes) -> None:
            raise AssertionError(f"the run task read {chunk!r}")

        def put_nowait(chunk: bytes) -> None:
            read_at[chunk] = round(trio.current_time() - start, 6)

        return RunOutput(put, put_nowait, poller)

    async def run() -> None:
        answer = await transport.request(b"POST", URL, HEADERS, b"", {"read": 5})
        await poller.relay(answer, output())

    async def no_wait() -> bool:
        return False

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.serve, no_wait)
        async with trio.open_nursery() as runs:
            for server, script in zip(servers, scripts, strict=True):
                runs.start_soon(run)
                nursery.start_soon(serve_chunks, server, script)
                await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    await transport.aclose()
    assert read_at == {b"a1": 0.1, b"b1": round(0.1 + TICK / 4, 6), b"a2": 1.1}


@pytest.mark.parametrize("head_alone", [False, True])
async def test_a_body_that_came_with_its_head_goes_to_last(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock, head_alone: bool
) -> None:
    """A run whose output has ``last``: a body that came whole with the head is handed to it, not
    queued (the session sends it with the run's end); a body that came after the head is queued."""
    (server,) = socket_upstreams(monkeypatch, 1)
    transport = H11Transport(1)
    poller = BodyPoller()
    collected = Collected()
    held: list[bytes] = []
    body = b'{"object":"chat.completion"}'

    async def serve() -> None:
        async with trio.SocketStream(trio.socket.from_stdlib_socket(server)) as stream:
            conn = h11.Connection(h11.SERVER)
            while type(event := conn.next_event()) is not h11.EndOfMessage:
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
            head = conn.send(h11.Response(status_code=200, headers=[("content-length", str(len(body)))])) or b""
            rest = (conn.send(h11.Data(data=body)) or b"") + (conn.send(h11.EndOfMessage()) or b"")
            if head_alone:
                await stream.send_all(head)
                await trio.sleep(0.1)
                await stream.send_all(rest)
            else:
                await stream.send_all(head + rest)
            await trio.sleep_forever()

    output = collected.output(poller)
    output.last = held.append
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.serve, collected.room)
        nursery.start_soon(serve)
        answer = await transport.request(b"POST", URL, HEADERS, b"", {"read": 5})
        await poller.relay(answer, output)
        nursery.cancel_scope.cancel()
    await transport.aclose()
    if head_alone:
        assert (collected.chunks, held) == ([("nowait", body)], [])
    else:
        assert (collected.chunks, held) == ([], [body])

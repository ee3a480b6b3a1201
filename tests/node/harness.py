"""Test harness for the Node tests: a fake Edge speaking the wire protocol, the mock backend,
and helpers that run a node in-process. Fixtures live in conftest.py.

The fake Edge is a real ``trio_websocket`` server on 127.0.0.1 port 0. Each accepted
connection is handed to the test as an :class:`EdgeConn` once the node registered.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import h11
import trio
import trio.testing
from trio_websocket import (
    CloseReason,
    ConnectionClosed,
    WebSocketConnection,
    WebSocketRequest,
    serve_websocket,
    wrap_client_stream,
    wrap_server_stream,
)

from iop_mock import MockBackend
from iop_node import EdgeClient, NodeConfig, NodeRuntime, ProviderConfig, ReconnectConfig, RuntimeConfig
from iop_wire import PROTOCOL_VERSIONS, Message, Register, Registered, Rejected, RunData, decode, decode_data, encode

TOKEN = "s3cret-node-token"


@attrs.define(eq=False)
class EdgeConn:
    """One node connection as the fake Edge sees it."""

    ws: WebSocketConnection
    register: Register
    inbox: trio.MemoryReceiveChannel[Message | RunData]
    closed: trio.Event = attrs.field(factory=trio.Event)
    close_reason: CloseReason | None = None

    async def send(self, message: Message) -> None:
        await self.ws.send_message(encode(message))

    async def receive(self) -> Message | RunData:
        return await self.inbox.receive()

    async def receive_until_end(self, run_id: str) -> list[Message | RunData]:
        """Collect every message of ``run_id`` up to and including its end (other messages are dropped)."""
        messages: list[Message | RunData] = []
        while True:
            message = await self.receive()
            if getattr(message, "run_id", None) != run_id:
                continue
            messages.append(message)
            if type(message).__name__ in ("RunEnd", "TunnelEnd"):
                return messages

    async def receive_for(self, run_id: str) -> Message | RunData:
        """The next message of ``run_id`` (heartbeats and other runs' messages skipped)."""
        while True:
            message = await self.receive()
            if getattr(message, "run_id", None) == run_id:
                return message


@attrs.define(eq=False)
class FakeEdge:
    """A wire-protocol Edge with scripted answers to ``register``.

    Attributes:
        heartbeat_interval_ms: sent in ``registered``.
        reject: when set, every registration is answered with this ``rejected``.
        protocols: the wire versions this Edge speaks (``(4,)``: an Edge one version behind).
        registers: every ``register`` received, in order.
    """

    heartbeat_interval_ms: int = 60_000
    reject: Rejected | None = None
    protocols: tuple[int, ...] = PROTOCOL_VERSIONS
    port: int = 0
    registers: list[Register] = attrs.field(factory=list)
    generation: int = 0
    _conns_send: trio.MemorySendChannel[EdgeConn] = attrs.field(init=False)
    _conns_receive: trio.MemoryReceiveChannel[EdgeConn] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._conns_send, self._conns_receive = trio.open_memory_channel[EdgeConn](16)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_websocket, self._handle, "127.0.0.1", 0, None)
            self.port = server.port
            task_status.started()

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    async def next_connection(self) -> EdgeConn:
        return await self._conns_receive.receive()

    async def _handle(self, request: WebSocketRequest) -> None:
        ws = await request.accept()
        await self.serve_connection(ws)

    async def serve_connection(self, ws: WebSocketConnection) -> None:
        """Answer ``register``, then queue every node message until the connection closes."""
        try:
            register = decode(await ws.get_message())
        except ConnectionClosed:
            return
        assert isinstance(register, Register)
        self.registers.append(register)
        reject = self.reject
        if reject is None and register.protocol not in self.protocols:
            reject = Rejected("protocol_mismatch", f"protocol {register.protocol} is not supported", False)
        if reject is not None:
            await ws.send_message(encode(reject))
            await ws.aclose(1008, "rejected")
            return
        self.generation += 1
        await ws.send_message(encode(Registered(register.node_id, self.generation, self.heartbeat_interval_ms)))
        inbox_send, inbox_receive = trio.open_memory_channel[Message | RunData](1000)
        conn = EdgeConn(ws, register, inbox_receive)
        await self._conns_send.send(conn)
        try:
            while True:
                frame = await ws.get_message()
                if isinstance(frame, bytes):
                    for record in decode_data(frame):  # a data frame: one item per record
                        inbox_send.send_nowait(record)
                else:
                    inbox_send.send_nowait(decode(frame))
        except ConnectionClosed as exc:
            conn.close_reason = exc.reason
        finally:
            inbox_send.close()
            conn.closed.set()


FAST_RECONNECT = ReconnectConfig(initial_ms=10, max_ms=50, jitter=0.2)


def node_config(
    edge_url: str,
    *providers: ProviderConfig,
    concurrency: int = 4,
    heartbeat_interval_ms: int = 60_000,
    reconnect: ReconnectConfig = FAST_RECONNECT,
) -> NodeConfig:
    """A NodeConfig for tests: fast reconnects, a long heartbeat unless asked otherwise."""
    return NodeConfig(
        node_id="node-a",
        edge_url=edge_url,
        providers=tuple(providers),
        token=TOKEN,
        heartbeat_interval_ms=heartbeat_interval_ms,
        runtime=RuntimeConfig(concurrency=concurrency),
        reconnect=reconnect,
    )


def openai_provider(port: int, id: str = "gpu0", capacity: int = 1, **kw: Any) -> ProviderConfig:
    return ProviderConfig(id=id, adapter="openai", base_url=f"http://127.0.0.1:{port}/v1", capacity=capacity, **kw)


@attrs.define(eq=False)
class RunningNode:
    client: EdgeClient
    runtime: NodeRuntime


@asynccontextmanager
async def running_node(config: NodeConfig) -> AsyncIterator[RunningNode]:
    """Run an in-process node (EdgeClient over real sockets) for the duration of the block."""
    async with NodeRuntime.from_config(config) as runtime:
        client = EdgeClient(config, runtime, rng=random.Random(0))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.run)
            yield RunningNode(client, runtime)
            client.shutdown()


@attrs.define(eq=False)
class Backend:
    backend: MockBackend
    port: int

    async def wait_idle(self) -> None:
        """Poll until no request is in flight (callers bound this with fail_after)."""
        while self.backend.stats()["in_flight"]:
            await trio.sleep(0.01)

    async def wait_in_flight(self, n: int) -> None:
        while self.backend.stats()["in_flight"] < n:
            await trio.sleep(0.01)


@attrs.define(eq=False)
class MemoryLink:
    """A connector over in-memory streams to a :class:`FakeEdge` (no sockets; MockClock-safe).

    Attributes:
        edge: serves each connection that gets through.
        failures: the first ``failures`` attempts raise ConnectionRefusedError.
        attempts: trio.current_time() of every attempt.
        server_streams: the Edge side of each connection (close one to drop it abruptly).
    """

    edge: FakeEdge
    edge_nursery: trio.Nursery
    failures: int = 0
    attempts: list[float] = attrs.field(factory=list)
    server_streams: list[trio.abc.Stream] = attrs.field(factory=list)

    @asynccontextmanager
    async def connect(self, nursery: trio.Nursery) -> AsyncIterator[WebSocketConnection]:
        self.attempts.append(trio.current_time())
        if len(self.attempts) <= self.failures:
            raise ConnectionRefusedError("refused by the test")
        client_stream, server_stream = trio.testing.memory_stream_pair()
        self.server_streams.append(server_stream)
        self.edge_nursery.start_soon(self._serve, server_stream)
        ws = await wrap_client_stream(nursery, client_stream, "edge", "/")
        try:
            yield ws
        finally:
            await client_stream.aclose()

    async def _serve(self, stream: trio.abc.Stream) -> None:
        async with trio.open_nursery() as nursery:
            request = await wrap_server_stream(nursery, stream)
            ws = await request.accept()
            await self.edge.serve_connection(ws)
            nursery.cancel_scope.cancel()


# ------------------------------------------------------------ a hostile backend

HEALTHY_ANSWER = (
    b'{"id":"c1","object":"chat.completion","created":1,"model":"m",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}'
)
"""The body of :func:`healthy`'s answer: a non-stream chat completion."""

Script = Callable[[], Iterator[bytes]]
"""What a :class:`HostileBackend` sends for one request, piece by piece (it stops when the peer closes)."""


def healthy() -> Iterator[bytes]:
    """A well-formed non-stream answer."""
    yield b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(HEALTHY_ANSWER)
    yield HEALTHY_ANSWER


def endless(first: bytes, piece: bytes, most: int = 256 * 1024 * 1024) -> Script:
    """``first``, then ``piece`` again and again (``most`` bytes in all, a guard for the test machine)."""

    def script() -> Iterator[bytes]:
        yield first
        for _ in range(most // len(piece)):
            yield piece

    return script


ENDLESS_HEAD = endless(b"HTTP/1.1 200 OK\r\nx-endless: ", b"a" * 65536)
"""A head whose one field never ends."""
HUGE_BODY = endless(
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 268435456\r\n\r\n", b" " * 65536
)
"""A non-stream answer of 256 MiB (blank JSON, sent until the Node stops reading)."""
HUGE_EXTENSION = endless(
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n5;x=", b"a" * 65536
)
"""A chunked answer whose first chunk's extension never ends."""
INFORMATIONAL_STORM = endless(b"", b"HTTP/1.1 100 Continue\r\n\r\n" * 1024)
"""1xx answers without end, and never the final one."""


@attrs.define(eq=False)
class HostileBackend:
    """A backend on 127.0.0.1 that reads each request (with h11), answers it with :attr:`script` and closes.

    Attributes:
        script: what the next requests get (the test sets it).
        port: the port it listens on.
        sent: bytes sent on each connection, in the order the connections ended.
        cut: connections whose peer (the Node) closed before the script ended.
    """

    script: Script = healthy
    port: int = 0
    sent: list[int] = attrs.field(factory=list)
    cut: int = 0

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        sent = 0
        try:
            async with stream:  # one answer per connection, then close: a script need not frame its answer
                if not await read_request(stream, h11.Connection(h11.SERVER)):
                    return
                for piece in self.script():
                    await stream.send_all(piece)
                    sent += len(piece)
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            self.cut += 1
        finally:
            self.sent.append(sent)


async def read_request(stream: trio.SocketStream, reader: h11.Connection) -> bool:
    """Read one whole request with ``reader`` (a server's h11 connection); False if the peer closed first."""
    while True:
        event = reader.next_event()
        if event is h11.NEED_DATA:
            reader.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.EndOfMessage):
            return True
        elif isinstance(event, h11.ConnectionClosed):
            return False

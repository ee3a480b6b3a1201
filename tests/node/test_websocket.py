"""EdgeSocket, the node's WebSocket client, against a wsproto server over a socket pair.

The rest of the node suite runs it against trio-websocket's server (the fake Edge).
"""

from __future__ import annotations

import socket

import pytest
import trio
from trio_websocket import ConnectionClosed, HandshakeError
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Message,
    Ping,
    Pong,
    RejectConnection,
    Request,
    TextMessage,
)

from iop_node.edges.websocket import EdgeSocket


class Server:
    """The Edge's end, driven with wsproto over a trio socket stream."""

    def __init__(self, sock: socket.socket) -> None:
        self.stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        self.ws = WSConnection(ConnectionType.SERVER)
        self.pending: list[Event] = []

    async def send(self, event: Event) -> None:
        await self.stream.send_all(self.ws.send(event))

    async def next_event(self) -> Event:
        while not self.pending:
            data = await self.stream.receive_some(65536)
            self.ws.receive_data(data or None)
            self.pending.extend(self.ws.events())
        return self.pending.pop(0)

    async def accept(self) -> None:
        assert isinstance(await self.next_event(), Request)
        await self.send(AcceptConnection())

    async def message(self) -> str | bytes:
        parts: list[str | bytes] = []
        while True:
            event = await self.next_event()
            assert isinstance(event, Message), event
            parts.append(event.data)
            if event.message_finished:
                return "".join(parts) if isinstance(event, TextMessage) else b"".join(parts)  # type: ignore[arg-type]


async def close(client: EdgeSocket, server: Server) -> None:
    """The client closes; the Edge answers its close frame."""

    async def edge() -> None:
        while not isinstance(event := await server.next_event(), CloseConnection):
            pass
        await server.send(event.response())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(edge)
        await client.aclose()
    await server.stream.aclose()


async def connected(*, max_message_size: int = 1 << 20, accept: bool = True) -> tuple[EdgeSocket, Server]:
    client_sock, server_sock = socket.socketpair()
    client_sock.setblocking(False)
    client = EdgeSocket(client_sock, max_message_size=max_message_size)
    server = Server(server_sock)
    async with trio.open_nursery() as nursery:
        if accept:
            nursery.start_soon(server.accept)
        await client.handshake("edge.test", "/node")
    return client, server


async def test_messages_whole_fragments_joined_and_ping_answered() -> None:
    with trio.fail_after(10):
        client, server = await connected()
        await server.send(TextMessage(data="frag", message_finished=False))
        await server.send(TextMessage(data="mented"))
        await server.send(Ping(payload=b"are you there"))
        await server.send(BytesMessage(data=b"\x00\x01"))
        assert await client.get_message() == "fragmented"
        assert await client.get_message() == b"\x00\x01"
        assert await server.next_event() == Pong(payload=b"are you there")
        await client.send_message("register")
        await client.send_message(b"data")
        assert [await server.message(), await server.message()] == ["register", b"data"]
        await close(client, server)


async def test_refused_handshake_and_close_before_the_answer_are_handshake_errors() -> None:
    with trio.fail_after(10):
        client_sock, server_sock = socket.socketpair()
        client_sock.setblocking(False)
        server = Server(server_sock)

        async def refuse() -> None:
            assert isinstance(await server.next_event(), Request)
            await server.send(RejectConnection(status_code=403))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(refuse)
            with pytest.raises(HandshakeError, match="status 403"):
                await EdgeSocket(client_sock, max_message_size=100).handshake("edge.test", "/")
        await server.stream.aclose()
        client_sock.close()
        client_sock, server_sock = socket.socketpair()
        client_sock.setblocking(False)
        server_sock.close()
        client = EdgeSocket(client_sock, max_message_size=100)
        with pytest.raises(HandshakeError, match="closed the connection before"):
            await client.handshake("edge.test", "/")
        await client.aclose()  # not open: closes the socket at once


async def test_message_over_the_limit_closes_with_1009() -> None:
    with trio.fail_after(10):
        client, server = await connected(max_message_size=10)
        await server.send(BytesMessage(data=b"x" * 11))
        with pytest.raises(ConnectionClosed) as raised:
            await client.get_message()
        assert raised.value.reason.code == 1009
        close = await server.next_event()
        assert isinstance(close, CloseConnection) and close.code == 1009
        await server.stream.aclose()


async def test_close_from_the_edge_is_answered_and_ends_the_connection() -> None:
    with trio.fail_after(10):
        client, server = await connected()
        await server.send(CloseConnection(code=1001, reason="edge going away"))
        with pytest.raises(ConnectionClosed) as raised:
            await client.get_message()
        assert (raised.value.reason.code, raised.value.reason.reason) == (1001, "edge going away")
        assert isinstance(await server.next_event(), CloseConnection)
        with pytest.raises(ConnectionClosed):
            await client.send_message("too late")
        await client.aclose()  # idempotent after a close
        await server.stream.aclose()


async def test_aclose_sends_a_close_frame_and_waits_for_the_answer() -> None:
    with trio.fail_after(10):
        client, server = await connected()

        async def edge() -> None:
            event = await server.next_event()
            assert isinstance(event, CloseConnection) and (event.code, event.reason) == (1001, "node going away")
            await server.send(event.response())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(edge)
            await client.aclose(1001, "node going away")
        assert client.closed is not None and client.closed.code == 1001
        await server.stream.aclose()


async def test_sends_from_several_tasks_stay_whole_and_in_order_through_a_full_buffer() -> None:
    """Messages larger than the socket buffers: senders wait their turn; the Edge reads each whole, in order."""
    with trio.fail_after(30):
        client, server = await connected(max_message_size=1 << 24)
        messages = [bytes([i]) * 300_000 for i in range(6)]
        received: list[str | bytes] = []

        async def edge() -> None:
            for _ in messages:
                received.append(await server.message())

        async def send(i: int, started: trio.Event) -> None:
            started.set()
            await client.send_message(messages[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(messages)):
                started = trio.Event()
                nursery.start_soon(send, i, started)
                await started.wait()
            nursery.start_soon(edge)
        assert received == messages
        await close(client, server)


async def test_send_messages_frames_them_in_order_into_one_write() -> None:
    """send_messages: every message framed whole and in order, in ONE write (the Edge's first read has them all)."""
    with trio.fail_after(10):
        client, server = await connected()
        await client.send_messages([b"records", '{"type":"run_end"}', b"more"])
        server.ws.receive_data(await server.stream.receive_some(65536))  # one read
        events = list(server.ws.events())
        assert [(type(e), e.data) for e in events if isinstance(e, Message)] == [
            (BytesMessage, b"records"),
            (TextMessage, '{"type":"run_end"}'),
            (BytesMessage, b"more"),
        ]
        await close(client, server)

"""The Edge's end of a node WebSocket (:class:`iop_edge.nodes.connection.NodeSocket`, wsproto read
by its caller) against trio-websocket's client, over in-memory streams on a MockClock: the
messages both ways, several in one write, pings, the size limit, and every way a connection ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
from trio_websocket import ConnectionClosed, WebSocketConnection, wrap_client_stream

from iop_edge.nodes.connection import NodeSocket


@asynccontextmanager
async def connected(max_message_bytes: int = 1024) -> AsyncIterator[tuple[NodeSocket, WebSocketConnection]]:
    """A NodeSocket after its handshake with a trio-websocket client on the other end."""
    client_end, server_end = trio.testing.memory_stream_pair()
    server = NodeSocket(server_end, max_message_bytes)
    async with trio.open_nursery() as nursery:
        accepted: list[bool] = []

        async def handshake() -> None:
            accepted.append(await server.handshake())

        nursery.start_soon(handshake)
        client = await wrap_client_stream(nursery, client_end, "edge", "/", max_message_size=1 << 20)
        await trio.testing.wait_all_tasks_blocked()
        assert accepted == [True]
        yield server, client
        nursery.cancel_scope.cancel()


async def test_messages_both_ways_and_several_in_one_write(autojump_clock: trio.testing.MockClock) -> None:
    """Text stays text, binary stays binary (fragmented ones joined); queued messages go out in one write."""
    with trio.fail_after(5):
        async with connected() as (server, client):
            await client.send_message("register")
            await client.send_message(b"\x00data")
            assert await server.get_message() == "register"
            assert await server.get_message() == b"\x00data"
            await server.send_messages(["one", "two", "three"])
            assert [await client.get_message() for _ in range(3)] == ["one", "two", "three"]
            await server.send_message(b"bytes")
            assert await client.get_message() == b"bytes"
            assert server.closed is None


async def test_a_ping_is_answered_while_reading(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(5):
        async with connected() as (server, client):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(server.get_message)
                await client.ping(b"are you there")  # returns once the pong came back
                nursery.cancel_scope.cancel()


async def test_a_message_over_the_limit_closes_with_1009(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(5):
        async with connected(max_message_bytes=100) as (server, client):
            await client.send_message(b"x" * 101)
            with pytest.raises(ConnectionClosed) as caught:
                await server.get_message()
            assert caught.value.reason.code == 1009
            with pytest.raises(ConnectionClosed) as seen:
                await client.get_message()
            assert seen.value.reason.code == 1009


async def test_the_peers_close_is_answered(autojump_clock: trio.testing.MockClock) -> None:
    """A close from the node is answered (its ``aclose`` returns) and read as the node's code."""
    with trio.fail_after(5):
        async with connected() as (server, client):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.aclose, 1001, "node going away")
                with pytest.raises(ConnectionClosed) as caught:
                    await server.get_message()
            assert caught.value.reason.code == 1001
            assert server.closed is not None and server.closed.code == 1001
            with pytest.raises(ConnectionClosed):
                await server.send_message("late")


async def test_a_lost_connection_reads_as_1006(autojump_clock: trio.testing.MockClock) -> None:
    client_end, server_end = trio.testing.memory_stream_pair()
    server = NodeSocket(server_end, 1024)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.handshake)
            await wrap_client_stream(nursery, client_end, "edge", "/")
            await client_end.aclose()  # no close frame
            with pytest.raises(ConnectionClosed) as caught:
                await server.get_message()
            assert caught.value.reason.code == 1006
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("reading", [True, False])
async def test_aclose_waits_for_the_answer_read_by_the_reader_or_itself(
    autojump_clock: trio.testing.MockClock, reading: bool
) -> None:
    """``aclose`` sends the close and returns once the node answered it, whether another task
    is reading the socket (it sees the answer) or nobody is (``aclose`` reads it)."""
    with trio.fail_after(5):
        async with connected() as (server, client):
            codes: list[int] = []

            async def read() -> None:
                with pytest.raises(ConnectionClosed) as caught:
                    await server.get_message()
                codes.append(caught.value.reason.code)

            async with trio.open_nursery() as nursery:
                if reading:
                    nursery.start_soon(read)
                    await trio.testing.wait_all_tasks_blocked()
                await server.aclose(1001, "edge shutting down")
            assert codes == ([1001] if reading else [])
            with pytest.raises(ConnectionClosed) as seen:
                await client.get_message()
            assert seen.value.reason.code == 1001


async def test_a_request_that_is_not_an_upgrade_is_refused(autojump_clock: trio.testing.MockClock) -> None:
    client_end, server_end = trio.testing.memory_stream_pair()
    server = NodeSocket(server_end, 1024)
    with trio.fail_after(5):
        await client_end.send_all(b"GET / HTTP/1.1\r\nhost: edge\r\n\r\n")
        assert not await server.handshake()
        answer = await client_end.receive_some()
        assert answer.startswith(b"HTTP/1.1 4")


async def test_a_peer_that_leaves_before_the_handshake(autojump_clock: trio.testing.MockClock) -> None:
    client_end, server_end = trio.testing.memory_stream_pair()
    await client_end.aclose()
    with trio.fail_after(5):
        assert not await NodeSocket(server_end, 1024).handshake()


class _TakesPart(trio.abc.Stream):
    """A stream whose ``write_nowait`` takes only the first ``limit`` bytes (a socket with little room);
    what it took reaches the peer with its next write, before anything sent later."""

    def __init__(self, inner: trio.abc.Stream, limit: int) -> None:
        self.inner = inner
        self.limit = limit
        self.taken = bytearray()

    def write_nowait(self, data: bytes) -> int:
        self.taken += data[: self.limit]
        return min(self.limit, len(data))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        taken, self.taken = bytes(self.taken), bytearray()
        await self.inner.send_all(taken + bytes(data))

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_send_nowait_keeps_what_the_socket_did_not_take_for_the_next_write(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """send_nowait: a message the socket takes none of is not sent (the caller keeps it); one whose
    bytes the socket took only in part is kept whole: its rest goes first in the next write
    (``send_messages([])`` alone sends it); meanwhile, and while another send holds the socket,
    send_nowait sends nothing and says so."""
    with trio.fail_after(5):
        client_end, server_end = trio.testing.memory_stream_pair()
        stream = _TakesPart(server_end, limit=5)
        server = NodeSocket(stream, 1024)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.handshake)
            client = await wrap_client_stream(nursery, client_end, "edge", "/", max_message_size=1 << 20)
            await trio.testing.wait_all_tasks_blocked()
            stream.limit = 0
            assert not server.send_nowait("none taken")  # nothing on the wire: not sent at all
            assert not server.backlogged
            stream.limit = 5
            assert server.send_nowait('{"type":"run","run_id":"r1"}')
            assert server.backlogged
            assert not server.send_nowait("behind")  # nothing sent: it would overtake the rest
            await server.send_messages([])
            assert not server.backlogged
            assert await client.get_message() == '{"type":"run","run_id":"r1"}'
            stream.limit = 1 << 20
            assert server.send_nowait(b"whole")
            assert not server.backlogged
            await server.send_messages([])  # (this stream passes on what it took with its next write)
            assert await client.get_message() == b"whole"
            async with server._send_lock:  # another send under way
                assert not server.send_nowait("later")
            nursery.cancel_scope.cancel()

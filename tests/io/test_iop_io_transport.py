"""iop_io's connection transport, once for every server that uses it (the Edge's listener, the mock backend).

Its checkpoint behaviour is the contract the servers rely on: a read is always a
schedule point (as trio's streams), a write of what the socket takes at once
never waits and never switches tasks, and what it does not take is written in
order by a flusher, also through a TLS-like stream (written by the flusher only).
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iop_io import PeerGone, SocketTransport, StreamTransport

TIMEOUT = 10.0


async def _socket_pair() -> tuple[SocketTransport, trio.SocketStream]:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await listener.accept()
    await listener.aclose()
    return SocketTransport(server), client


async def test_socket_transport_reads_at_a_schedule_point_and_writes_without_one(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        transport, client = await _socket_pair()
        transport.nursery = nursery
        await client.send_all(b"ready")
        await trio.testing.wait_all_tasks_blocked()
        with trio.testing.assert_checkpoints():
            assert await transport.receive_some() == b"ready"
        with trio.testing.assert_no_checkpoints():
            assert transport.write_nowait(b"answer") is True
            await transport.wait_written()
        assert await client.receive_some() == b"answer"
        assert transport.receive_nowait() is None
        await client.aclose()
        assert await transport.receive_some() == b""
        await transport.aclose()
        assert transport.broken


async def test_socket_transport_flushes_what_the_socket_did_not_take_in_order(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        transport, client = await _socket_pair()
        transport.nursery = nursery
        pieces = [bytes([65 + i % 26]) * 100_000 for i in range(40)]  # 4 MB: more than the socket buffers hold
        for piece in pieces:
            transport.write_nowait(piece)
        assert transport.pending  # the rest waits for the flusher
        received = bytearray()
        while len(received) < 4_000_000:
            received += await client.receive_some()
        await transport.wait_written()
        assert bytes(received) == b"".join(pieces) and not transport.pending
        await transport.aclose()
        await client.aclose()


async def test_stream_transport_is_written_by_its_flusher_only(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        server, client = trio.testing.memory_stream_pair()
        transport = StreamTransport(server)
        transport.nursery = nursery
        with trio.testing.assert_no_checkpoints():
            transport.write_nowait(b"one ")
            transport.write_nowait(b"two")
        assert transport.pending == b"one two"
        await transport.wait_written()
        assert await client.receive_some() == b"one two"
        await client.send_all(b"request")
        assert await transport.receive_some() == b"request"
        await client.aclose()
        assert await transport.receive_some() == b""
        await transport.aclose()
        with pytest.raises(PeerGone):
            await transport.receive_some()

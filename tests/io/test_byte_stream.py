"""iop_io.ByteStream, the one byte mover, and iop_io.ReadySet, the one poller helper.

A ByteStream's contract, which every daemon relies on: bytes already waiting
are read, and a write the socket takes whole is written, without a task switch;
only a read with nothing there, or a write the socket has no room for, waits;
every failure (the peer gone, the socket closed under the call) is PeerGone.
Through a trio stream (TLS) the stream's own methods do the work.
"""

from __future__ import annotations

import socket

import pytest
import trio
import trio.lowlevel
import trio.testing

from iop_io import CAN_POLL, ByteStream, PeerGone, ReadySet

TIMEOUT = 10.0


def _pair() -> tuple[ByteStream, socket.socket]:
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    return ByteStream(ours), theirs


def _fill(sock: socket.socket) -> int:
    """Write to ``sock`` until its buffers are full; the bytes written."""
    total = 0
    while True:
        try:
            total += sock.send(b"x" * 65536)
        except BlockingIOError:
            return total


async def test_bytes_waiting_are_read_and_a_write_taken_whole_is_written_without_a_task_switch() -> None:
    io, peer = _pair()
    peer.send(b"waiting")
    assert await io.receive_some() == b"waiting"
    with trio.testing.assert_no_checkpoints():
        await io.send_all(b"answer")
    assert peer.recv(100) == b"answer"
    assert io.receive_nowait() is None
    peer.close()
    assert await io.receive_some() == b""
    io.close()
    io.close()  # idempotent
    assert io.fileno() == -1


async def test_a_read_waits_for_bytes_and_a_schedule_read_is_a_schedule_point(nursery: trio.Nursery) -> None:
    io, peer = _pair()
    got: list[bytes] = []
    read_done = trio.Event()

    async def read() -> None:
        got.append(await io.receive_some())
        read_done.set()

    nursery.start_soon(read)
    await trio.testing.wait_all_tasks_blocked()
    assert got == []
    peer.send(b"late")
    with trio.fail_after(TIMEOUT):
        while not got:
            await trio.lowlevel.checkpoint()
    assert got == [b"late"]
    peer.send(b"again")
    with trio.testing.assert_checkpoints():
        assert await io.receive_some(schedule=True) == b"again"
    io.close()
    peer.close()


async def test_a_read_when_readable_waits_first_and_takes_what_came() -> None:
    io, peer = _pair()
    peer.send(b"answer")
    with trio.testing.assert_checkpoints():
        assert await io.receive_when_readable() == b"answer"
    peer.close()
    assert await io.receive_when_readable() == b""
    io.close()
    with pytest.raises(PeerGone):
        await io.receive_when_readable()


async def test_flush_writes_what_the_socket_did_not_take_and_what_was_appended_meanwhile(nursery: trio.Nursery) -> None:
    io, peer = _pair()
    assert io.fileno() >= 0
    sock = socket.socket(fileno=socket.dup(io.fileno()))  # to fill our side's buffers
    sock.setblocking(False)
    filled = _fill(sock)
    sock.close()
    pending = bytearray(b"first")
    done = trio.Event()

    async def flush() -> None:
        await io.flush(pending)
        done.set()

    nursery.start_soon(flush)
    await trio.testing.wait_all_tasks_blocked()
    pending += b" second"
    assert not done.is_set()
    received = bytearray()
    with trio.fail_after(TIMEOUT):
        while len(received) < filled + len(b"first second"):
            await trio.lowlevel.wait_readable(peer)
            received += peer.recv(1 << 20)
        await done.wait()
    assert received[filled:] == b"first second"
    assert not pending
    io.close()
    peer.close()


async def test_every_failure_is_peer_gone() -> None:
    io, peer = _pair()
    peer.close()
    with pytest.raises(PeerGone):
        for _ in range(100):  # the first writes may still be taken before the reset is seen
            io.send_now(b"x" * 65536)
    io.close()
    with pytest.raises(PeerGone):
        io.receive_nowait()
    with pytest.raises(PeerGone):
        await io.wait_readable()


async def test_a_read_closed_under_its_wait_is_peer_gone(nursery: trio.Nursery) -> None:
    io, peer = _pair()
    failed: list[BaseException] = []
    read_done = trio.Event()

    async def read() -> None:
        try:
            await io.receive_some()
        except PeerGone as exc:
            failed.append(exc)
        read_done.set()

    nursery.start_soon(read)
    await trio.testing.wait_all_tasks_blocked()
    io.close()
    with trio.fail_after(TIMEOUT):
        while not failed:
            await trio.lowlevel.checkpoint()
    assert isinstance(failed[0], PeerGone)
    peer.close()


async def test_through_a_trio_stream_the_stream_moves_the_bytes() -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    io = ByteStream(ours)
    assert not io.plain and io.fileno() == -1
    assert io.send_now(b"x") == 0  # a stream is written only by awaiting it
    assert io.receive_nowait() is None
    pending = bytearray(b"through the stream")
    await io.flush(pending)
    assert not pending
    assert await theirs.receive_some() == b"through the stream"
    await theirs.send_all(b"back")
    assert await io.receive_some() == b"back"
    await theirs.aclose()
    with pytest.raises(PeerGone):
        await io.send_all(b"more")
    await io.aclose()


async def test_borrowing_a_socket_stream_reads_its_socket_and_leaves_it_the_stream_s() -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    client = await trio.open_tcp_stream("127.0.0.1", listener.socket.getsockname()[1])
    server = await listener.accept()
    await listener.aclose()
    io = ByteStream.borrowing(server)
    assert io.plain and io.fileno() == server.socket.fileno()
    await client.send_all(b"hello")
    with trio.fail_after(TIMEOUT):
        assert await io.receive_some() == b"hello"
    await io.send_all(b"back")
    assert await client.receive_some() == b"back"
    await io.aclose()  # closes through the stream
    assert server.socket.fileno() == -1
    await client.aclose()


@pytest.mark.skipif(not CAN_POLL, reason="ReadySet needs epoll (Linux)")
async def test_a_ready_set_finds_the_readable_sockets_of_many_in_one_wait() -> None:
    pairs = [socket.socketpair() for _ in range(3)]
    names = ["s0", "s1", "s2"]
    ready: ReadySet[str] = ReadySet()
    for (ours, _), name in zip(pairs, names, strict=True):
        ready.add(ours.fileno(), name)
    assert len(ready) == 3 and ready.ready() == []
    pairs[0][1].send(b"a")
    pairs[2][1].send(b"c")
    with trio.fail_after(TIMEOUT):
        await ready.wait()
    assert sorted(item for _, item in ready.ready()) == ["s0", "s2"]
    fd0 = pairs[0][0].fileno()
    assert not ready.discard(fd0, "someone else's")
    assert ready.discard(fd0, names[0])
    assert [item for _, item in ready.ready()] == ["s2"]  # level-triggered: still readable, still found
    assert ready.get(fd0) is None and len(ready.watched()) == 2
    ready.close()
    with pytest.raises((OSError, ValueError)):
        ready.add(fd0, names[0])
    for ours, theirs in pairs:
        ours.close()
        theirs.close()


@pytest.mark.skipif(not CAN_POLL, reason="ReadySet needs epoll (Linux)")
def test_an_edge_triggered_ready_set_reports_a_socket_once_per_arrival() -> None:
    ours, theirs = socket.socketpair()
    ready: ReadySet[str] = ReadySet(edge=True)
    ready.add(ours.fileno(), "s")
    theirs.send(b"a")
    assert [item for _, item in ready.ready()] == ["s"]
    assert ready.ready() == []  # unread, but reported once: its owner reads until a read comes short
    theirs.send(b"b")
    assert [item for _, item in ready.ready()] == ["s"]
    assert ours.recv(16) == b"ab"
    ready.close()
    ours.close()
    theirs.close()

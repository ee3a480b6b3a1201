"""One client connection's bytes, both ways, for a server: :class:`Transport` on a :class:`ByteStream`.

Writes never wait on the client: bytes go to the socket at once from
whichever task has them, and what it does not take waits in the transport's
buffer for a flusher task (:data:`WRITE_BUFFER_LIMIT` bounds it for body
chunks). A TLS stream is written by the flusher only.
"""

from __future__ import annotations

import socket
from typing import final

import trio

from .byte_stream import CLOSE_TIMEOUT, ByteStream, PeerGone

WRITE_BUFFER_LIMIT = 256 * 1024
"""Bytes waiting for one client past which a body chunk written without waiting is refused."""


class Transport:
    """The bytes of one client connection, both ways, with an outgoing buffer.

    :meth:`write_nowait` hands bytes to the operating system at once when
    nothing is waiting before them (no task switch); what the socket does not
    take waits in :attr:`pending`, written in order by a flusher task started in
    the connection's nursery. So whoever has bytes for the client (the
    connection's own task, or a node link's reader relaying a run) writes them
    without waiting on the client, and a slow client costs only memory bounded
    by :data:`WRITE_BUFFER_LIMIT`.
    """

    __slots__ = ("io", "pending", "broken", "nursery", "_flushing", "_drained")

    def __init__(self, io: ByteStream) -> None:
        self.io = io
        self.pending = bytearray()
        self.broken = False
        self.nursery: trio.Nursery | None = None  # set by the connection before any write
        self._flushing = False
        self._drained = trio.Event()

    def write_nowait(self, data: bytes) -> bool:
        """Write ``data`` after what is pending (never waits).

        Returns:
            False when the bytes waiting for the client exceed
            :data:`WRITE_BUFFER_LIMIT` (``data`` is kept all the same).
            A broken connection takes and drops everything.
        """
        if self.broken:
            return True
        if not self._flushing:
            try:
                sent = self.io.send_now(data)
            except PeerGone:
                self.broken = True
                return True
            if sent == len(data):
                return True
            self.pending += memoryview(data)[sent:]
            self._flushing = True
            self._drained = trio.Event()
            assert self.nursery is not None
            self.nursery.start_soon(self._flush_pending)
            return len(self.pending) <= WRITE_BUFFER_LIMIT
        self.pending += data
        return len(self.pending) <= WRITE_BUFFER_LIMIT

    async def send_all(self, data: bytes) -> None:
        """Write ``data`` and wait until every pending byte is written (or the client is gone).

        Checkpoints only when the socket did not take everything at once.
        Cancelled, the bytes stay pending and are still written in order.
        """
        self.write_nowait(data)
        await self.wait_written()

    async def wait_written(self) -> None:
        """Wait until every pending byte is written (or the client is gone). Checkpoints only when it waits."""
        if self._flushing:
            await self._drained.wait()

    async def wait_below_limit(self) -> None:
        """Wait while more than :data:`WRITE_BUFFER_LIMIT` bytes wait for the client.

        Checkpoints only when it waits.
        """
        while self._flushing and len(self.pending) > WRITE_BUFFER_LIMIT:
            await self._drained.wait()

    async def _flush_pending(self) -> None:
        try:
            await self.io.flush(self.pending)
        except PeerGone:
            self.broken = True
            self.pending.clear()
        finally:
            self._flushing = False
            self._drained.set()

    async def receive_some(self) -> bytes:
        """The next bytes from the client; ``b""`` at its end (raises :class:`PeerGone`). Checkpoints."""
        return await self.io.receive_some(schedule=True)

    def receive_nowait(self) -> bytes | None:
        """The bytes the client already sent (``b""`` at its end), or None if none wait (or, for a
        stream, always). Never waits; raises :class:`PeerGone`."""
        return self.io.receive_nowait()

    async def aclose(self) -> None:
        """Close the connection, gracefully when that is quick: never takes longer than
        :data:`CLOSE_TIMEOUT` (or the stream's ``close_timeout``). Checkpoints."""
        self.broken = True
        await self.io.aclose()


@final
class SocketTransport(Transport):
    """A plain TCP connection, driven as a non-blocking stdlib socket (:class:`ByteStream`).

    Writing a body chunk is then one ``send`` system call from the task that has
    the bytes; trio's ``SocketStream.send_all`` always reschedules its task too.
    """

    __slots__ = ()

    def __init__(self, stream: trio.SocketStream) -> None:
        super().__init__(ByteStream(socket.socket(fileno=stream.socket.detach())))


@final
class StreamTransport(Transport):
    """A connection spoken through a trio stream (TLS: a ``trio.SSLStream``); the flusher writes."""

    __slots__ = ()

    def __init__(self, stream: trio.abc.Stream, close_timeout: float = CLOSE_TIMEOUT) -> None:
        super().__init__(ByteStream(stream, close_timeout))

"""One client connection's bytes, both ways, for a server: a non-blocking socket or a stream (TLS).

Writes never wait on the client: bytes go to the socket at once from
whichever task has them, and what it does not take waits in the transport's
buffer for a flusher task (:data:`WRITE_BUFFER_LIMIT` bounds it for body
chunks). A TLS stream is written by the flusher only.
"""

from __future__ import annotations

import logging
import socket
from typing import final

import trio

logger = logging.getLogger("iop_io")

RECEIVE_SIZE = 65536
"""Bytes asked of the socket per read."""


class PeerGone(Exception):
    """The client closed, broke or stalled the connection."""


WRITE_BUFFER_LIMIT = 256 * 1024
"""Bytes waiting for one client past which a body chunk written without waiting is refused."""

CLOSE_TIMEOUT = 5.0
"""Seconds a stream's graceful close may take (TLS: its ``close_notify``, which waits for room in the
socket's buffers, so forever for a client that does not read) before the connection is dropped."""


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

    __slots__ = ("pending", "broken", "nursery", "_flushing", "_drained")

    def __init__(self) -> None:
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
                sent = self._send_now(data)
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
            await self._flush()
        except PeerGone:
            self.broken = True
            self.pending.clear()
        finally:
            self._flushing = False
            self._drained.set()

    def _send_now(self, data: bytes) -> int:
        """Bytes of ``data`` the connection took without waiting (raises :class:`PeerGone`)."""
        raise NotImplementedError

    async def _flush(self) -> None:
        """Write :attr:`pending` until it is empty, waiting as needed (raises :class:`PeerGone`)."""
        raise NotImplementedError

    async def receive_some(self) -> bytes:
        """The next bytes from the client; ``b""`` at its end (raises :class:`PeerGone`). Checkpoints."""
        raise NotImplementedError

    def receive_nowait(self) -> bytes | None:
        """The bytes the client already sent (``b""`` at its end), or None if none wait (or, for a
        stream, always). Never waits; raises :class:`PeerGone`."""
        return None

    async def aclose(self) -> None:
        """Close the connection, gracefully when that is quick: never takes longer than
        :data:`CLOSE_TIMEOUT` (or the stream's ``close_timeout``). Checkpoints."""
        raise NotImplementedError


@final
class SocketTransport(Transport):
    """A plain TCP connection, driven as a non-blocking stdlib socket with trio's low-level waits.

    Writing a body chunk is then one ``send`` system call from the task that has
    the bytes; trio's ``SocketStream.send_all`` always reschedules its task too.
    """

    __slots__ = ("sock",)

    def __init__(self, stream: trio.SocketStream) -> None:
        super().__init__()
        self.sock = socket.socket(fileno=stream.socket.detach())
        self.sock.setblocking(False)

    def _send_now(self, data: bytes) -> int:
        try:
            return self.sock.send(data)
        except BlockingIOError:
            return 0
        except OSError:
            raise PeerGone from None

    async def _flush(self) -> None:
        pending = self.pending
        while pending:
            await trio.lowlevel.wait_writable(self.sock)
            try:
                sent = self.sock.send(pending)
            except BlockingIOError:
                continue
            except OSError:
                raise PeerGone from None
            del pending[:sent]

    async def receive_some(self) -> bytes:
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            try:
                data = self.sock.recv(RECEIVE_SIZE)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)
                waited = True
                continue
            except OSError:
                raise PeerGone from None
            if not waited:
                await trio.lowlevel.cancel_shielded_checkpoint()  # a schedule point, as trio's streams
            return data

    def receive_nowait(self) -> bytes | None:
        try:
            return self.sock.recv(RECEIVE_SIZE)
        except BlockingIOError:
            return None
        except OSError:
            raise PeerGone from None

    async def aclose(self) -> None:
        self.broken = True
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()
        await trio.lowlevel.checkpoint()


@final
class StreamTransport(Transport):
    """A connection spoken through a trio stream (TLS: a ``trio.SSLStream``); the flusher writes."""

    __slots__ = ("stream", "close_timeout")

    def __init__(self, stream: trio.abc.Stream, close_timeout: float = CLOSE_TIMEOUT) -> None:
        super().__init__()
        self.stream = stream
        self.close_timeout = close_timeout

    def _send_now(self, data: bytes) -> int:
        return 0  # a stream is written only by awaiting it: the flusher does

    async def _flush(self) -> None:
        while self.pending:
            data = bytes(self.pending)
            self.pending.clear()
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise PeerGone from None

    async def receive_some(self) -> bytes:
        try:
            # bytes() returns a plain socket's bytes as they are; TLS gives a bytearray.
            return bytes(await self.stream.receive_some(RECEIVE_SIZE))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise PeerGone from None

    async def aclose(self) -> None:
        self.broken = True
        # A graceful close may wait on the client (a TLS close_notify needs room in the socket's
        # buffers; a peer that never reads never makes any): bounded, then dropped.
        with trio.move_on_after(self.close_timeout) as timer:
            await self.stream.aclose()
        if timer.cancelled_caught:
            logger.info("a connection's graceful close took over %.3g s: dropped", self.close_timeout)
            await trio.aclose_forcefully(self.stream)

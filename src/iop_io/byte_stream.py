"""One connection's bytes, both ways: :class:`ByteStream`, the byte mover of every daemon.

A plain TCP connection is driven as a non-blocking socket with trio's public
low-level waits (``wait_readable`` / ``wait_writable``), only when a call would
block: a ``trio.SocketStream`` reschedules its task on every call, even when
the system call succeeds at once, and a relay pays that per token. So a read
with bytes waiting, or a write the socket takes whole, costs no task switch
here. Anything else (TLS: a ``trio.SSLStream``; the simulation's in-memory
streams) goes through its trio stream.

Every failure of the connection, and a socket closed under a call, is
:class:`PeerGone`; each user maps it to its own errors in one place.
"""

from __future__ import annotations

import logging
import os
import select
import socket
from collections.abc import Awaitable, Callable
from typing import Final, final

import trio

logger = logging.getLogger("iop_io")

RECEIVE_SIZE: Final = 65536
"""Bytes asked of the socket per read."""

CLOSE_TIMEOUT: Final = 5.0
"""Seconds a stream's graceful close may take (TLS: its ``close_notify``, which waits for room in the
socket's buffers, so forever for a peer that does not read) before the connection is dropped."""

_STREAM_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError)
_WAIT_ERRORS = (trio.ClosedResourceError, OSError, ValueError)  # closed under the wait, or before it (fileno -1)


class PeerGone(Exception):
    """The peer closed, broke or stalled the connection, or it was closed under the call."""


@final
class ByteStream:
    """The bytes of one connection: a non-blocking socket, or a trio stream.

    ``transport``: a connected ``socket.socket`` (owned: made non-blocking, closed
    by :meth:`close`), or a trio stream (TLS), used through its own methods
    (:meth:`borrowing`: a plain ``trio.SocketStream``'s socket directly).
    """

    __slots__ = ("_sock", "_send", "_recv", "stream", "close_timeout")

    def __init__(self, transport: socket.socket | trio.abc.Stream, close_timeout: float = CLOSE_TIMEOUT) -> None:
        self.close_timeout = close_timeout
        self._sock: socket.socket | trio.socket.SocketType | None = None
        self._send: Callable[[bytes | bytearray | memoryview], int] | None = None
        self._recv: Callable[[int], bytes] | None = None
        self.stream: trio.abc.Stream | None = None
        """The trio stream the connection is spoken through (None: a socket of our own)."""
        if isinstance(transport, socket.socket):
            transport.setblocking(False)
            self._sock, self._send, self._recv = transport, transport.send, transport.recv
        else:
            self.stream = transport

    @classmethod
    def borrowing(cls, stream: trio.abc.Stream) -> ByteStream:
        """The bytes of ``stream``: a ``trio.SocketStream``'s socket read and written directly (the
        stream still owns it, and closing either closes it), any other stream through itself."""
        io = cls(stream)
        if isinstance(stream, trio.SocketStream):
            sock = io._sock = stream.socket
            # By its descriptor, asked at every call: once the stream closed it, the number may be another socket's.
            io._send = lambda data: os.write(sock.fileno(), data)
            io._recv = lambda size: os.read(sock.fileno(), size)
        return io

    @property
    def plain(self) -> bool:
        """Whether the bytes go straight to a socket (else through a trio stream: TLS)."""
        return self._sock is not None

    def fileno(self) -> int:
        """The socket's descriptor; -1 through a trio stream only, or once closed."""
        sock = self._sock
        return -1 if sock is None else sock.fileno()

    def send_now(self, data: bytes | bytearray | memoryview) -> int:
        """Bytes of ``data`` the socket took now, without waiting (0 through a trio stream only).

        Raises:
            PeerGone: the connection failed or is closed.
        """
        send = self._send
        if send is None:
            return 0
        try:
            return send(data)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise PeerGone(str(exc)) from None

    async def flush(self, pending: bytearray) -> None:
        """Write ``pending`` until it is empty, bytes appended to it meanwhile included. Checkpoints.

        A socket is written as it has room (a first wait for it, then what it takes);
        a stream takes what is pending in one ``send_all`` at a time. Cancelled, the
        bytes not written stay in ``pending``.

        Raises:
            PeerGone: the connection failed or is closed.
        """
        if self._sock is None:
            stream = self.stream
            assert stream is not None
            while pending:
                data = bytes(pending)
                pending.clear()
                try:
                    await stream.send_all(data)
                except _STREAM_ERRORS:
                    raise PeerGone from None
            return
        while pending:
            await self._wait(trio.lowlevel.wait_writable)
            del pending[: self.send_now(pending)]

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Write all of ``data``: at once when the socket takes it whole (no checkpoint), else waiting for room.

        Raises:
            PeerGone: the connection failed or is closed.
        """
        sent = self.send_now(data)
        if sent < len(data):
            await self.flush(bytearray(memoryview(data)[sent:]))

    async def receive_some(self, size: int = RECEIVE_SIZE, *, schedule: bool = False) -> bytes:
        """The next bytes from the peer, ``b""`` at its end.

        Checkpoints if cancelled and when it waits; bytes already waiting in the socket
        cost no task switch, unless ``schedule`` (a schedule point as trio's streams
        make: a loop of reads lets other tasks run). Through a trio stream: its own.

        Raises:
            PeerGone: the connection failed or is closed.
        """
        if self._sock is None:
            stream = self.stream
            assert stream is not None
            try:
                # bytes(): TLS gives a bytearray.
                return bytes(await stream.receive_some(size))
            except _STREAM_ERRORS:
                raise PeerGone from None
        await trio.lowlevel.checkpoint_if_cancelled()
        data = self.receive_nowait(size)
        if data is not None:
            if schedule:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return data
        while data is None:
            await self.wait_readable()
            data = self.receive_nowait(size)
        return data

    async def receive_when_readable(self, size: int = RECEIVE_SIZE) -> bytes:
        """The next bytes from the peer, ``b""`` at its end, waiting for readability first. Checkpoints.

        For bytes that are rarely there yet when asked (the answer to a request just
        sent, the next message of a quiet peer): a read that finds nothing would cost a
        failed system call before the wait anyway. Through a trio stream: its own read.

        Raises:
            PeerGone: the connection failed or is closed.
        """
        if self._sock is None:
            return await self.receive_some(size)
        while True:
            await self.wait_readable()
            data = self.receive_nowait(size)
            if data is not None:  # else a spurious wake-up
                return data

    def receive_nowait(self, size: int = RECEIVE_SIZE) -> bytes | None:
        """The bytes the peer already sent (``b""`` at its end), or None if none wait (through
        a trio stream only: always). Never waits.

        Raises:
            PeerGone: the connection failed or is closed.
        """
        recv = self._recv
        if recv is None:
            return None
        try:
            return recv(size)
        except BlockingIOError:
            return None
        except OSError as exc:
            raise PeerGone(str(exc)) from None

    async def wait_readable(self) -> None:
        """Wait until the socket has bytes (or their end) to read. Checkpoints.

        Raises:
            PeerGone: the socket was closed (before or during the wait).
        """
        await self._wait(trio.lowlevel.wait_readable)

    async def _wait(self, wait: Callable[[socket.socket | trio.socket.SocketType], Awaitable[None]]) -> None:
        sock = self._sock
        assert sock is not None
        try:
            await wait(sock)
        except _WAIT_ERRORS as exc:
            raise PeerGone(str(exc) or "the socket was closed") from None

    def readable_now(self) -> bool:
        """Whether a read would not block now (for an idle connection: its end, or bytes never asked for)."""
        fd = self.fileno()
        if fd < 0:
            return True
        if not hasattr(select, "poll"):
            return bool(select.select([fd], [], [], 0)[0])
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))

    def end_sending(self) -> None:
        """Send the end of this side's bytes (TCP's FIN) and keep reading: the peer reads its end,
        and its own end (or a reset) is read here. Synchronous; nothing through a trio stream only,
        or once closed."""
        sock = self._sock
        if sock is not None and sock.fileno() >= 0:
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:  # the connection is gone already: reading finds out
                pass

    def close(self) -> None:
        """Close the socket now, waking any task waiting on it (nothing through a trio stream only).

        Synchronous and idempotent: safe in a cancelled task.
        """
        sock = self._sock
        if sock is not None and sock.fileno() >= 0:
            trio.lowlevel.notify_closing(sock)
            sock.close()

    async def aclose(self) -> None:
        """Close the connection, gracefully when that is quick: a trio stream's close may take at
        most :attr:`close_timeout` seconds before it is dropped. Checkpoints."""
        stream = self.stream
        if stream is None:
            self.close()
            await trio.lowlevel.checkpoint()
            return
        # A graceful close may wait on the peer (a TLS close_notify needs room in the socket's
        # buffers; a peer that never reads never makes any): bounded, then dropped.
        with trio.move_on_after(self.close_timeout) as timer:
            await stream.aclose()
        if timer.cancelled_caught:
            logger.info("a connection's graceful close took over %.3g s: dropped", self.close_timeout)
            await trio.aclose_forcefully(stream)

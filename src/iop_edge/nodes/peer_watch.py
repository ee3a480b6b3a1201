"""A node connection's stream before and after registration: :class:`PeerWatch`, :class:`PendingSlot`.

:class:`PeerWatch` reads and writes the connection's socket and notes when its peer has gone;
:class:`PendingSlot` is the connection's place in the pending count until it registers.
"""

from __future__ import annotations

import logging
import os
from typing import final

import trio

from iop_edge.nodes.limits import PendingLimits, Source
from iop_wire import (
    RECEIVE_BYTES,
)

logger = logging.getLogger("iop_edge.nodes")


@final
class PendingSlot:
    """One connection's place in the pending count; :meth:`release` is idempotent."""

    __slots__ = ("held", "limits", "source")

    def __init__(self, limits: PendingLimits, source: Source) -> None:
        self.limits = limits
        self.source = source
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.limits.release(self.source)


@final
class PeerWatch(trio.abc.Stream):
    """A stream that sets :attr:`ended` once its peer closed it or it broke (reads only).

    On a plain TCP stream, reads and writes are non-blocking system calls on
    its socket, waiting with trio's ``wait_readable`` / ``wait_writable`` only
    when the socket is not ready: a read with data waiting, or a write the
    socket takes whole, then costs no task switch (trio's stream reschedules
    the task on every call). TLS goes through the stream.
    """

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.ended = trio.Event()
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None

    def _fd(self) -> int:
        """The socket's descriptor; -1 for a TLS stream or once the stream is closed."""
        return -1 if self._socket is None else self._socket.fileno()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        fd = self._fd()
        try:
            if fd >= 0:
                data: bytes | bytearray = await self._read(fd, max_bytes or RECEIVE_BYTES)
            else:
                data = await self.stream.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.ended.set()
            raise
        if not data:
            self.ended.set()
        return data

    async def _read(self, fd: int, size: int) -> bytes:
        """Read the socket; waits (a checkpoint) only when nothing is there yet."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                return os.read(fd, size)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(fd)
            except OSError as exc:
                raise trio.BrokenResourceError(exc) from exc
            fd = self._fd()
            if fd < 0:
                raise trio.ClosedResourceError("the node's socket was closed")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        fd = self._fd()
        if fd < 0:
            await self.stream.send_all(data)
            return
        await trio.lowlevel.checkpoint_if_cancelled()
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view) :]
                continue
            except BlockingIOError:
                await trio.lowlevel.wait_writable(fd)
            except OSError as exc:
                raise trio.BrokenResourceError(exc) from exc
            fd = self._fd()
            if fd < 0:
                raise trio.ClosedResourceError("the node's socket was closed")

    def write_nowait(self, data: bytes) -> int:
        """Bytes of ``data`` the socket took now (none for a TLS stream, which is written by awaiting it).

        Raises:
            trio.BrokenResourceError: the socket failed.
        """
        fd = self._fd()
        if fd < 0:
            return 0
        try:
            return os.write(fd, data)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise trio.BrokenResourceError(exc) from exc

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        self.ended.set()
        await self.stream.aclose()


def peer_host(stream: trio.abc.Stream) -> str | None:
    """The peer's IP address; None for a stream without a socket, or a peer already gone."""
    sock = getattr(stream, "socket", None)
    if sock is None:
        return None
    try:
        return str(sock.getpeername()[0])
    except (OSError, IndexError, TypeError):
        return None

"""A node connection's stream before and after registration: :class:`PeerWatch`, :class:`PendingSlot`.

:class:`PeerWatch` reads and writes the connection's socket and notes when its peer has gone;
:class:`PendingSlot` is the connection's place in the pending count until it registers.
"""

from __future__ import annotations

import logging
from typing import final

import trio

from iop_edge.nodes.limits import PendingLimits, Source
from iop_io import ByteStream, PeerGone
from iop_wire import RECEIVE_BYTES

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

    Its bytes move through an :class:`iop_io.ByteStream` borrowing the stream: on
    a plain TCP stream, a read with data waiting, or a write the socket takes
    whole, costs no task switch (trio's stream reschedules the task on every
    call). TLS goes through the stream.
    """

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.ended = trio.Event()
        self._io = ByteStream.borrowing(stream)

    def _gone(self) -> trio.BrokenResourceError | trio.ClosedResourceError:
        """trio's error for a :class:`iop_io.PeerGone`: closed if the socket was closed under the call."""
        if self._io.plain and self._io.fileno() < 0:
            return trio.ClosedResourceError("the node's socket was closed")
        return trio.BrokenResourceError("the node's connection broke")

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        try:
            data = await self._io.receive_some(max_bytes or RECEIVE_BYTES)
        except PeerGone:
            self.ended.set()
            raise self._gone() from None
        if not data:
            self.ended.set()
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            await self._io.send_all(data)
        except PeerGone:
            raise self._gone() from None

    def write_nowait(self, data: bytes) -> int:
        """Bytes of ``data`` the socket took now (none for a TLS stream, which is written by awaiting it).

        Raises:
            trio.BrokenResourceError: the socket failed.
        """
        try:
            return self._io.send_now(data)
        except PeerGone:
            raise self._gone() from None

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

"""The Edge's end of a node connection: a WebSocket (server role) read by the task that wants its messages.

:class:`NodeSocket` is :class:`iop_wire.WebSocketEnd` (wsproto, no task of its
own: :meth:`~iop_wire.WebSocketEnd.get_message` reads the socket and parses its
frames in the caller's task, so a node frame goes from the socket to the runs'
clients in one task) with the server's opening handshake, on a trio stream.
Sends from several tasks are serialized by a lock, each write whole;
:meth:`~iop_wire.WebSocketEnd.send_messages` frames several messages into one
write, and :meth:`NodeSocket.send_nowait` writes one message from a task that
cannot wait (the bytes the socket does not take then go first in the next write). A close from the node is answered and then ends the TCP connection (the
server closes first).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import final

import trio
from trio_websocket import ConnectionClosed
from wsproto import ConnectionType
from wsproto.events import AcceptConnection, BytesMessage, Request, TextMessage
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from iop_wire import RECEIVE_BYTES, WebSocketEnd

logger = logging.getLogger("iop_edge.nodes")


@final
class NodeSocket(WebSocketEnd):
    """One node's WebSocket on ``stream`` (server side), read by its caller.

    Call :meth:`handshake` first. One task reads at a time (:meth:`get_message`);
    sends from several tasks are serialized, each message whole.
    """

    __slots__ = ("stream", "_send_lock", "_write_now", "_backlog")

    def __init__(self, stream: trio.abc.Stream, max_message_bytes: int) -> None:
        super().__init__(ConnectionType.SERVER, max_message_bytes)
        self.stream = stream
        """The stream the WebSocket is spoken on."""
        self._send_lock = trio.Lock()
        self._write_now: Callable[[bytes], int] | None = getattr(stream, "write_nowait", None)
        """The stream's ``write_nowait(data) -> bytes taken now``, if it has one."""
        self._backlog = b""
        """Bytes of a message sent by :meth:`send_nowait` that the socket did not take: the next write sends them first."""

    @property
    def backlogged(self) -> bool:
        """Whether bytes of a :meth:`send_nowait` wait for the next write (any send, or ``send_messages([])``)."""
        return bool(self._backlog)

    def send_nowait(self, message: str | bytes) -> bool:
        """Send ``message`` now without waiting, if no other send is under way. Does not checkpoint.

        Returns:
            False when nothing was sent (a send is under way, bytes wait in the
            backlog, the connection is closed, the socket took none of it, or
            the stream has no ``write_nowait``): send it with
            :meth:`send_messages`. True when the message is taken whole:
            written, or, when the socket took only a part, its rest in the
            backlog (see :attr:`backlogged`), which the next write sends first.

        Raises:
            ConnectionClosed: the socket failed.
        """
        write_now = self._write_now
        if write_now is None or self._backlog or self.closed is not None or self._send_lock.locked():
            return False
        data = self._ws.send(TextMessage(message) if isinstance(message, str) else BytesMessage(message))
        try:
            sent = write_now(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._lost(f"send failed: {exc!r}")
        if not sent:
            return False  # nothing on the wire: the frame is the caller's again
        if sent < len(data):
            self._backlog = data[sent:]
        return True

    async def handshake(self) -> bool:
        """Read the opening request and accept it. Checkpoints.

        Returns:
            False when the peer left first, or sent something other than a
            WebSocket upgrade (answered with wsproto's rejection when possible).
        """
        ws = self._ws
        while True:
            for event in ws.events():
                if isinstance(event, Request):
                    await self._write(ws.send(AcceptConnection()))
                    logger.debug("node socket: WebSocket handshake done")
                    return True
            data = await self._receive()
            if not data:
                return False
            try:
                ws.receive_data(data)
            except RemoteProtocolError as exc:
                if exc.event_hint is not None:
                    try:
                        await self._write(ws.send(exc.event_hint))
                    except (ConnectionClosed, LocalProtocolError):
                        pass
                return False

    async def _write(self, data: bytes) -> None:
        lock = self._send_lock
        try:
            lock.acquire_nowait()  # no scheduling round for a free lock (the stream's write checkpoints if it waits)
        except trio.WouldBlock:
            await lock.acquire()
        try:
            if self._backlog:
                data, self._backlog = self._backlog + data, b""
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._lost(f"send failed: {exc!r}")
        finally:
            lock.release()

    async def _receive(self) -> bytes:
        try:
            data = await self.stream.receive_some(RECEIVE_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""
        return data if type(data) is bytes else bytes(data)  # TLS reads give a bytearray

    async def _close_transport(self) -> None:
        await self.stream.aclose()


async def close_quietly(ws: NodeSocket, code: int, reason: str) -> None:
    """Close ``ws`` with ``code`` and ``reason``, shielded and bounded (1 s); a closed socket is fine."""
    with trio.move_on_after(1.0) as scope:
        scope.shield = True
        try:
            await ws.aclose(code, reason)
        except ConnectionClosed:
            pass

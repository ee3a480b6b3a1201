"""The Edge's end of a node connection: a WebSocket spoken with wsproto, read by the task that wants its messages.

trio-websocket (which the Node and the simulation's in-memory connections use)
runs a reader task per connection and hands every message to its consumer
through a channel: for the node link's reader, a task switch and a scheduling
round per node frame, on the path of every token. :class:`NodeSocket` offers
the part of trio-websocket's connection the node link uses (``get_message``,
``send_message``, ``aclose``, ``closed``, and its :class:`ConnectionClosed`),
with wsproto doing every bit of the WebSocket protocol, but without a task of
its own: :meth:`NodeSocket.get_message` reads the socket and parses its frames
in the caller's task, so a node frame goes from the socket to the runs'
clients in one task. :meth:`NodeSocket.send_messages` frames several messages
into one write.

Behaviour kept from trio-websocket: pings are answered, a message larger than
the limit closes the connection with 1009, a close from the peer is answered
and ends the TCP connection (the server closes first), a connection lost
without a close reads as 1006, and :meth:`NodeSocket.aclose` sends a close and
waits for the peer's answer (read by whoever is reading, or by ``aclose``
itself when nobody is).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from typing import cast, final

import trio
from trio_websocket import CloseReason, ConnectionClosed
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

logger = logging.getLogger("iop_edge.nodes")

RECEIVE_BYTES = 65536
"""Bytes read from a node's socket at once (a frame of many records, several frames)."""
ABNORMAL_CLOSURE = 1006
"""The close code of a connection that ended without a close frame (never sent on the wire)."""
MESSAGE_TOO_BIG = 1009


@final
class NodeSocket:
    """One node's WebSocket on ``stream`` (server side), read by its caller.

    Call :meth:`handshake` first. One task reads at a time (:meth:`get_message`);
    sends from several tasks are serialized, each message whole.
    """

    def __init__(self, stream: trio.abc.Stream, max_message_bytes: int) -> None:
        self.stream = stream
        """The stream the WebSocket is spoken on."""
        self._ws = WSConnection(ConnectionType.SERVER)
        self._max_message_bytes = max_message_bytes
        self._events: deque[Event] = deque()
        self._parts: list[str | bytes | bytearray] = []
        self._size = 0
        self._send_lock = trio.Lock()
        self._reading = False
        self._finished = trio.Event()  # the close handshake is over or the connection is lost
        self._close_reason: CloseReason | None = None

    @property
    def closed(self) -> CloseReason | None:
        """Why the connection closed (or is closing); None while it is open."""
        return self._close_reason

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

    async def get_message(self) -> str | bytes:
        """The next whole message (text: ``str``, binary: ``bytes``). Checkpoints when it reads.

        Raises:
            ConnectionClosed: the connection closed (its :attr:`closed` reason), now or before.
        """
        while True:
            while self._events:
                message = await self._take(self._events.popleft())
                if message is not None:
                    return message
            if self._close_reason is not None:
                raise ConnectionClosed(self._close_reason)
            self._reading = True
            try:
                data = await self._receive()
            finally:
                self._reading = False
            if not data or self._ws.state is ConnectionState.CLOSED:
                self._lost()
                continue
            self._ws.receive_data(data)
            self._events.extend(self._ws.events())

    async def _take(self, event: Event) -> str | bytes | None:
        """Act on one event; the message it completes, if any."""
        if isinstance(event, TextMessage | BytesMessage):
            self._parts.append(event.data)
            self._size += len(event.data)
            if self._size > self._max_message_bytes:
                reason = f"Exceeded maximum message size: {self._max_message_bytes} bytes"
                self._parts, self._size = [], 0
                await self._begin_close(MESSAGE_TOO_BIG, reason)
                raise ConnectionClosed(CloseReason(MESSAGE_TOO_BIG, reason))
            if not event.message_finished:
                return None
            parts, self._parts, self._size = self._parts, [], 0
            if isinstance(event, BytesMessage):
                return b"".join(cast("list[bytes | bytearray]", parts))
            return "".join(cast("list[str]", parts))
        if isinstance(event, Ping):
            await self._send_control(event.response())
        elif isinstance(event, CloseConnection):
            await self._peer_closed(event)
        return None

    async def _peer_closed(self, event: CloseConnection) -> None:
        """The peer's close: answer it (unless it answers ours), then end the TCP connection."""
        if self._ws.state is ConnectionState.REMOTE_CLOSING:
            self._close_reason = CloseReason(event.code, event.reason or None)
            await self._send_control(event.response())
        elif self._close_reason is None:
            self._close_reason = CloseReason(event.code, event.reason or None)
        self._finish()
        await self.stream.aclose()
        raise ConnectionClosed(self._close_reason)

    def _lost(self) -> None:
        """The stream ended or broke: the connection is over (1006 unless a close came first)."""
        if self._close_reason is None:
            self._close_reason = CloseReason(ABNORMAL_CLOSURE, None)
        self._finish()

    def _finish(self) -> None:
        if not self._finished.is_set():
            self._finished.set()
            logger.debug("node socket: WebSocket closed (%d)", self._close_reason.code if self._close_reason else 0)

    async def send_message(self, message: str | bytes) -> None:
        """Send one message. Checkpoints.

        Raises:
            ConnectionClosed: the connection is closed or closing.
        """
        await self.send_messages((message,))

    async def send_messages(self, messages: Iterable[str | bytes]) -> None:
        """Send ``messages`` in order, framed into one write. Checkpoints.

        Raises:
            ConnectionClosed: the connection is closed or closing.
        """
        if self._close_reason is not None:
            raise ConnectionClosed(self._close_reason)
        send = self._ws.send
        framed = [
            send(TextMessage(data=message) if isinstance(message, str) else BytesMessage(data=message))
            for message in messages
        ]
        await self._write(framed[0] if len(framed) == 1 else b"".join(framed))

    async def aclose(self, code: int = 1000, reason: str | None = None) -> None:
        """Close with ``code`` and wait for the peer's answer, then end the TCP connection.

        Checkpoints; bound it (and shield it) from the caller. Succeeds on a
        connection that is closed already.
        """
        try:
            if self._close_reason is None and self._ws.state is ConnectionState.OPEN:
                await self._begin_close(code, reason)
                if self._reading:
                    await self._finished.wait()  # the reading task sees the answer
                else:
                    await self._read_until_finished()
        except ConnectionClosed:
            pass
        finally:
            self._finish()
            await self.stream.aclose()

    async def _begin_close(self, code: int, reason: str | None) -> None:
        self._close_reason = CloseReason(code, reason)
        await self._send_control(CloseConnection(code=code, reason=reason))

    async def _read_until_finished(self) -> None:
        """Read (dropping messages) until the peer answers the close or leaves."""
        while not self._finished.is_set():
            while self._events:
                event = self._events.popleft()
                if isinstance(event, CloseConnection):
                    await self._peer_closed(event)
            data = await self._receive()
            if not data or self._ws.state is ConnectionState.CLOSED:
                self._lost()
                return
            self._ws.receive_data(data)
            self._events.extend(self._ws.events())

    async def _send_control(self, event: Event) -> None:
        try:
            data = self._ws.send(event)
        except LocalProtocolError:
            return  # the connection is past the state where it could go out
        await self._write(data)

    async def _write(self, data: bytes) -> None:
        async with self._send_lock:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._lost()
                raise ConnectionClosed(self._close_reason) from None

    async def _receive(self) -> bytes:
        try:
            data = await self.stream.receive_some(RECEIVE_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""
        return data if type(data) is bytes else bytes(data)  # TLS reads give a bytearray

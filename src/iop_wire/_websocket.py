"""One end of a WebSocket, driven with wsproto: whole messages, pings, the closing handshake.

Both ends of the node link build on :class:`WebSocketEnd`: the Edge's
``NodeSocket`` (the server role) and the Node's ``EdgeSocket`` (the client
role). wsproto does every bit of the WebSocket protocol; this class only moves
bytes and has no task of its own: the task that asks for the next message reads
the transport and parses its frames itself. Each role supplies the opening
handshake and its transport, with three methods: :meth:`WebSocketEnd._receive`
(bytes, ``b""`` at the end), :meth:`WebSocketEnd._write` (one write, whole; a
failure raises through :meth:`WebSocketEnd._lost`) and
:meth:`WebSocketEnd._close_transport`.

What both ends do the same way:

- A message larger than the limit (all its fragments together) sends a close
  with 1009, closes the transport and raises.
- A ping is answered; a close from the peer is answered (unless it answers
  ours), the transport is closed, and :class:`ConnectionClosed` carries the
  peer's code.
- A transport that ends or breaks without a close reads as 1006.
- :meth:`WebSocketEnd.aclose` sends a close and waits for the peer's answer:
  read by whichever task is reading the connection, or by ``aclose`` itself
  when none is. It closes the transport in any case.

Errors are trio-websocket's public ones (``ConnectionClosed`` with a
``CloseReason``), so code above treats this connection and a
``trio_websocket.WebSocketConnection`` alike.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any, NoReturn

import trio
from trio_websocket import CloseReason, ConnectionClosed
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import BytesMessage, CloseConnection, Event, Message, Ping, TextMessage
from wsproto.utilities import LocalProtocolError

from ._errors import CLOSE_TOO_BIG

__all__ = ["ABNORMAL_CLOSURE", "RECEIVE_BYTES", "WebSocketEnd"]

RECEIVE_BYTES = 65536
"""Bytes read from the transport at once (a frame of many records, several frames)."""
ABNORMAL_CLOSURE = 1006
"""The close code of a connection that ended without a close frame (never sent on the wire)."""


class WebSocketEnd:
    """The message layer of one WebSocket end; a subclass gives the handshake and the transport.

    One task reads at a time (:meth:`get_message`); how sends from several
    tasks are ordered is the subclass's :meth:`_write`. ``closed``: why the
    connection closed (or is closing), None while it is open.
    """

    __slots__ = ("_ws", "_max_message_bytes", "_events", "_parts", "_size", "_reading", "_finished", "closed")

    def __init__(self, role: ConnectionType, max_message_bytes: int) -> None:
        self._ws = WSConnection(role)
        self._max_message_bytes = max_message_bytes
        self._events: deque[Event] = deque()
        self._parts: list[Any] = []
        self._size = 0
        self._reading = False
        self._finished = trio.Event()  # the close handshake is over or the connection is lost
        self.closed: CloseReason | None = None

    # ---------------------------------------------------------- the transport

    async def _receive(self) -> bytes:
        """Bytes from the transport; ``b""`` at its end or when it failed. Checkpoints."""
        raise NotImplementedError

    async def _write(self, data: bytes) -> None:
        """Send ``data`` whole, in order with other writes.

        Raises:
            ConnectionClosed: the transport failed (raise it with :meth:`_lost`).
        """
        raise NotImplementedError

    async def _close_transport(self) -> None:
        """Close the transport (idempotent; a bounded wait at most)."""
        raise NotImplementedError

    # --------------------------------------------------------------- messages

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
            if self.closed is not None:
                raise ConnectionClosed(self.closed)
            self._reading = True
            try:
                data = await self._receive()
            finally:
                self._reading = False
            if not data or self._ws.state is ConnectionState.CLOSED:
                self._end(ABNORMAL_CLOSURE, "the peer closed the transport without a close frame")
                continue
            self._ws.receive_data(data)
            self._events.extend(self._ws.events())

    async def _take(self, event: Event) -> str | bytes | None:
        """Act on one event; the message it completes, if any."""
        if isinstance(event, Message):
            self._parts.append(event.data)
            self._size += len(event.data)
            if self._size > self._max_message_bytes:
                self._parts, self._size = [], 0
                await self._close_now(CLOSE_TOO_BIG, f"message larger than {self._max_message_bytes} bytes")
            if not event.message_finished:
                return None
            parts, self._parts, self._size = self._parts, [], 0
            if isinstance(event, TextMessage):
                return parts[0] if len(parts) == 1 else "".join(parts)
            return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
        if isinstance(event, Ping):
            await self._send_control(event.response())
        elif isinstance(event, CloseConnection):
            await self._peer_closed(event)
        return None

    async def send_message(self, message: str | bytes) -> None:
        """Send one message. Checkpoints as the subclass's write does.

        Raises:
            ConnectionClosed: the connection is closed or closing, or the transport failed.
        """
        if self.closed is not None:
            raise ConnectionClosed(self.closed)
        await self._write(self._ws.send(TextMessage(message) if isinstance(message, str) else BytesMessage(message)))

    async def send_messages(self, messages: Iterable[str | bytes]) -> None:
        """Send ``messages`` in order, framed into one write (at least one message).

        Raises:
            ConnectionClosed: the connection is closed or closing, or the transport failed.
        """
        if self.closed is not None:
            raise ConnectionClosed(self.closed)
        send = self._ws.send
        framed = [send(TextMessage(m) if isinstance(m, str) else BytesMessage(m)) for m in messages]
        await self._write(framed[0] if len(framed) == 1 else b"".join(framed))

    # ---------------------------------------------------------------- closing

    async def aclose(self, code: int = 1000, reason: str | None = None) -> None:
        """Close with ``code``, wait for the peer's answer, close the transport. Idempotent. Checkpoints.

        Bound (and shield) it from the caller: the peer may never answer. The
        transport is closed whatever happens.
        """
        try:
            if self.closed is None and self._ws.state is ConnectionState.OPEN:
                self.closed = CloseReason(code, reason)
                await self._write(self._ws.send(CloseConnection(code=code, reason=reason)))
                if self._reading:
                    await self._finished.wait()  # the reading task sees the answer
                else:
                    await self._read_until_finished()
        except ConnectionClosed:
            pass
        finally:
            self._finished.set()
            await self._close_transport()

    async def _read_until_finished(self) -> None:
        """Read (dropping messages) until the peer answers the close or leaves."""
        while not self._finished.is_set():
            while self._events:
                event = self._events.popleft()
                if isinstance(event, CloseConnection):
                    await self._peer_closed(event)
            data = await self._receive()
            if not data or self._ws.state is ConnectionState.CLOSED:
                self._finished.set()
                return
            self._ws.receive_data(data)
            self._events.extend(self._ws.events())

    async def _peer_closed(self, event: CloseConnection) -> NoReturn:
        """The peer's close: answer it (unless it answers ours), close the transport, raise."""
        if self._ws.state is ConnectionState.REMOTE_CLOSING:
            self.closed = CloseReason(event.code, event.reason or None)
            await self._send_quietly(event.response())
        elif self.closed is None:
            self.closed = CloseReason(event.code, event.reason or None)
        self._finished.set()
        await self._close_transport()
        raise ConnectionClosed(self.closed)

    async def _close_now(self, code: int, reason: str) -> NoReturn:
        """This end ends the connection (a limit broken): a close frame, the transport closed, raise."""
        self.closed = CloseReason(code, reason)
        await self._send_quietly(CloseConnection(code=code, reason=reason))
        self._finished.set()
        await self._close_transport()
        raise ConnectionClosed(self.closed)

    async def _send_control(self, event: Event) -> None:
        """Send a control frame, unless the connection is past the state where it could go out.

        Raises:
            ConnectionClosed: the transport failed.
        """
        try:
            data = self._ws.send(event)
        except LocalProtocolError:
            return
        await self._write(data)

    async def _send_quietly(self, event: Event) -> None:
        """Send a control frame if the connection's state allows it and the transport takes it."""
        try:
            await self._send_control(event)
        except ConnectionClosed:
            pass

    def _end(self, code: int, why: str) -> None:
        """The transport ended or broke: the connection is over (``code`` unless a close came first)."""
        if self.closed is None:
            self.closed = CloseReason(code, why)
        self._finished.set()

    def _lost(self, why: str) -> NoReturn:
        """Raise for a transport that failed under a write (1006 unless a close came first)."""
        self._end(ABNORMAL_CLOSURE, why)
        raise ConnectionClosed(self.closed)

"""The node's end of the Edge link: a WebSocket client driven with wsproto, :class:`EdgeSocket`.

Why not trio-websocket here (measured with ``benchmarks fleet`` at 64 streams, trio
instrumentation of the Node): a message sent through it cost the writer task
three trips through the scheduler (its wakeup, the connection's send lock, the
socket stream's send), about 185 µs of CPU per frame on the shared benchmark box,
and every message received hopped from its reader task through a channel. Here
wsproto does the WebSocket protocol (handshake, framing, masking, the closing
handshake) and this module only moves bytes:

- Sending: the frame goes out with one non-blocking ``send`` on the node's own
  socket, without a checkpoint; only a full send buffer waits (for writability).
  Bytes are sent in the order the messages were given, never interleaved: a
  task that finds another one waiting for the socket appends its frame behind
  and waits its turn, and bytes left by a cancelled send go out first. A message
  is taken whole or not at all (a cancelled send still sends it).
- Receiving: the task that asks for the next message reads the socket itself (no
  reader task); a ping is answered, a close is answered and ends the connection.
- TLS (``wss://``): the same over a ``trio.SSLStream`` (every send through it).

Errors are trio-websocket's public ones (``ConnectionClosed`` with a
``CloseReason``, ``HandshakeError``), so the session and the reconnect loop treat
this connection and a ``trio_websocket.WebSocketConnection`` alike.
"""

from __future__ import annotations

import logging
import socket
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, NoReturn, Protocol

import trio
from trio_websocket import CloseReason, ConnectionClosed, HandshakeError
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Message,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)

logger = logging.getLogger("iop_node")

_RECEIVE_SIZE = 64 * 1024
_ABNORMAL = 1006
_TOO_BIG = 1009


class EdgeWebSocket(Protocol):
    """What a session needs of its open connection: :class:`EdgeSocket`, or a
    ``trio_websocket.WebSocketConnection`` (some tests wrap in-memory streams with it)."""

    @property
    def closed(self) -> CloseReason | None: ...

    async def send_message(self, message: str | bytes) -> None: ...

    async def get_message(self) -> str | bytes: ...

    async def aclose(self, code: int = 1000, reason: str | None = None) -> None: ...


@asynccontextmanager
async def open_edge_socket(
    transport: socket.socket | trio.abc.Stream,
    host: str,
    resource: str,
    *,
    max_message_size: int,
    handshake_timeout: float,
    close_timeout: float,
) -> AsyncIterator[EdgeSocket]:
    """An :class:`EdgeSocket` on ``transport`` (a connected socket or stream), its handshake done.

    On exit it sends a close frame (if still open), waits at most ``close_timeout``
    seconds for the Edge's, and closes ``transport`` whatever happens (shielded).

    Raises (on entering):
        HandshakeError: the Edge refused the handshake or closed the connection first.
        trio.TooSlowError: no answer to the handshake within ``handshake_timeout`` seconds.
    """
    ws = EdgeSocket(transport, max_message_size=max_message_size)
    try:
        with trio.fail_after(handshake_timeout):
            await ws.handshake(host, resource)
        yield ws
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(close_timeout):
            await ws.aclose()


class EdgeSocket:
    """One open WebSocket client connection on a socket (or stream) it owns.

    Use :func:`open_edge_socket`. ``closed``: why the connection closed, None while open.
    """

    __slots__ = ("_sock", "_stream", "_ws", "_max_size", "_out", "_lock", "_events", "_parts", "_size", "closed")

    def __init__(self, transport: socket.socket | trio.abc.Stream, *, max_message_size: int) -> None:
        self._sock = transport if isinstance(transport, socket.socket) else None
        self._stream = None if isinstance(transport, socket.socket) else transport
        self._ws = WSConnection(ConnectionType.CLIENT)
        self._max_size = max_message_size
        self._out = bytearray()
        self._lock = trio.Lock()
        self._events: deque[Event] = deque()
        self._parts: list[Any] = []
        self._size = 0
        self.closed: CloseReason | None = None

    async def handshake(self, host: str, resource: str) -> None:
        """The client's opening handshake. Checkpoints.

        Raises:
            HandshakeError: the server refused it or closed the connection before answering.
        """
        closed_first = "the edge closed the connection before the WebSocket handshake"
        try:
            await self._send(self._ws.send(Request(host=host, target=resource)))
        except ConnectionClosed:
            raise HandshakeError(closed_first) from None
        while True:
            data = await self._receive()
            if not data:
                raise HandshakeError(closed_first)
            self._ws.receive_data(data)
            events = list(self._ws.events())
            for i, event in enumerate(events):
                if isinstance(event, AcceptConnection):
                    self._events.extend(events[i + 1 :])
                    logger.debug("websocket open to %s", host)
                    return
                if isinstance(event, RejectConnection):
                    raise HandshakeError(f"the edge refused the WebSocket handshake with status {event.status_code}")

    async def send_message(self, message: str | bytes) -> None:
        """Send one message. Checkpoints only when it has to wait for the socket (see the module docstring).

        Raises:
            ConnectionClosed: the connection is closed or the socket failed.
        """
        if self.closed is not None:
            raise ConnectionClosed(self.closed)
        event = TextMessage(data=message) if isinstance(message, str) else BytesMessage(data=message)
        await self._send(self._ws.send(event))

    async def get_message(self) -> str | bytes:
        """The next message. Checkpoints only when it reads the socket.

        Raises:
            ConnectionClosed: the connection closed (by the Edge, or it dropped).
        """
        while True:
            while self._events:
                message = await self._handle(self._events.popleft())
                if message is not None:
                    return message
            if self.closed is not None:
                raise ConnectionClosed(self.closed)
            data = await self._receive()
            if not data:
                self._drop("the edge closed the socket without a close frame")
            self._ws.receive_data(data)
            self._events.extend(self._ws.events())

    async def _handle(self, event: Event) -> str | bytes | None:
        """One wsproto event: a complete message is returned, a ping answered, a close ends the connection."""
        if isinstance(event, Message):
            self._parts.append(event.data)
            self._size += len(event.data)
            if self._size > self._max_size:
                await self._close_now(_TOO_BIG, f"message larger than {self._max_size} bytes")
            if not event.message_finished:
                return None
            parts, self._parts, self._size = self._parts, [], 0
            if isinstance(event, TextMessage):
                return parts[0] if len(parts) == 1 else "".join(parts)
            return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
        if isinstance(event, Ping):
            await self._send(self._ws.send(event.response()))
        elif isinstance(event, CloseConnection):
            self.closed = CloseReason(event.code, event.reason)
            if self._ws.state is ConnectionState.REMOTE_CLOSING:
                await self._send_quietly(event.response())
            self._close_transport()
            raise ConnectionClosed(self.closed)
        return None

    async def aclose(self, code: int = 1000, reason: str | None = None) -> None:
        """Close: send a close frame (if open), wait for the Edge's, close the socket. Idempotent. Checkpoints.

        The caller bounds the wait (the Edge may never answer); the socket is closed whatever happens.
        """
        try:
            if self._ws.state is ConnectionState.OPEN:
                logger.debug("websocket closing with %d %s", code, reason or "")
                self.closed = CloseReason(code, reason)
                await self._send(self._ws.send(CloseConnection(code=code, reason=reason)))
                await self._wait_for_close()
        except ConnectionClosed:
            pass
        finally:
            self._close_transport()
            if self._stream is not None:
                await trio.aclose_forcefully(self._stream)

    async def _wait_for_close(self) -> None:
        """Read (and drop messages) until the Edge's close frame or the end of the socket."""
        while self._ws.state is not ConnectionState.CLOSED:
            data = await self._receive()
            if not data:
                return
            self._ws.receive_data(data)
            for event in self._ws.events():
                if isinstance(event, CloseConnection):
                    return

    async def _close_now(self, code: int, reason: str) -> NoReturn:
        """We end the connection (a protocol limit broken): send a close frame, close the socket, raise."""
        self.closed = CloseReason(code, reason)
        await self._send_quietly(CloseConnection(code=code, reason=reason))
        self._close_transport()
        raise ConnectionClosed(self.closed)

    async def _send_quietly(self, event: Event) -> None:
        try:
            await self._send(self._ws.send(event))
        except ConnectionClosed:
            pass

    async def _send(self, data: bytes) -> None:
        """Queue ``data`` behind what is queued and send it all; see the module docstring."""
        out = self._out
        out += data
        if not self._lock.locked():
            self._push()
            if not out:
                return
        async with self._lock:
            while out:
                if self._stream is not None:
                    pending = bytes(out)
                    out.clear()
                    try:
                        await self._stream.send_all(pending)
                    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                        self._drop(f"send failed: {exc}")
                else:
                    await self._wait_writable()
                    self._push()

    def _push(self) -> None:
        """Send what the socket takes now (a plain socket; nothing for a stream)."""
        if self._sock is None:
            return
        try:
            sent = self._sock.send(self._out)
        except BlockingIOError:
            return
        except OSError as exc:
            self._drop(f"send failed: {exc}")
        del self._out[:sent]

    async def _wait_writable(self) -> None:
        assert self._sock is not None
        try:
            await trio.lowlevel.wait_writable(self._sock)
        except trio.ClosedResourceError:
            self._drop("the socket was closed")

    async def _receive(self) -> bytes:
        """Bytes from the socket, b"" at its end (or when it failed). Checkpoints."""
        if self._stream is not None:
            try:
                return bytes(await self._stream.receive_some(_RECEIVE_SIZE))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return b""
        sock = self._sock
        assert sock is not None
        while True:
            try:
                await trio.lowlevel.wait_readable(sock)
                return sock.recv(_RECEIVE_SIZE)
            except BlockingIOError:
                continue
            except (OSError, trio.ClosedResourceError):
                return b""

    def _drop(self, why: str) -> NoReturn:
        """The connection is gone without a closing handshake: close the socket and raise."""
        if self.closed is None:
            self.closed = CloseReason(_ABNORMAL, why)
        self._close_transport()
        raise ConnectionClosed(self.closed)

    def _close_transport(self) -> None:
        """Close a plain socket now (a stream is closed by :meth:`aclose`). Synchronous, idempotent."""
        sock = self._sock
        if sock is not None and sock.fileno() >= 0:
            trio.lowlevel.notify_closing(sock)
            sock.close()

"""The node's end of the Edge link: a WebSocket client driven with wsproto, :class:`EdgeSocket`.

It is :class:`iop_wire.WebSocketEnd` (wsproto: messages, pings, the closing
handshake, shared with the Edge's end) with the client's opening handshake and
a transport of its own.

Why not trio-websocket here: a message sent through it cost the writer task three
trips through the scheduler (its wakeup, the connection's send lock, the socket
stream's send), and every message received hopped from its reader task through a channel. Here
wsproto does the WebSocket protocol (handshake, framing, masking, the closing
handshake) and this module only moves bytes:

- Sending: the frame goes out with one non-blocking ``send`` on the node's own
  socket (an :class:`iop_io.ByteStream`), without a checkpoint; only a full send
  buffer waits (for writability).
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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import NoReturn, Protocol

import trio
from trio_websocket import CloseReason, ConnectionClosed, HandshakeError
from wsproto import ConnectionType
from wsproto.events import AcceptConnection, Ping, RejectConnection, Request

from iop_io import ByteStream, PeerGone
from iop_wire import ABNORMAL_CLOSURE, RECEIVE_BYTES, WebSocketEnd

logger = logging.getLogger("iop_node")


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


class EdgeSocket(WebSocketEnd):
    """One open WebSocket client connection on a socket (or stream) it owns.

    Use :func:`open_edge_socket`. ``closed``: why the connection closed, None while open.
    """

    __slots__ = ("_io", "_out", "_lock", "received_at")

    def __init__(self, transport: socket.socket | trio.abc.Stream, *, max_message_size: int) -> None:
        super().__init__(ConnectionType.CLIENT, max_message_size)
        self._io = ByteStream(transport)
        self._out = bytearray()
        self._lock = trio.Lock()
        self.received_at = trio.current_time()
        """When bytes last came from the Edge (any frame, a pong too): :meth:`keep_alive` reads it."""

    @property
    def buffered(self) -> bool:
        """Whether frames read from the socket wait to be taken (the next :meth:`get_message` may not read)."""
        return bool(self._events)

    async def handshake(self, host: str, resource: str) -> None:
        """The client's opening handshake. Checkpoints.

        Raises:
            HandshakeError: the server refused it or closed the connection before answering.
        """
        closed_first = "the edge closed the connection before the WebSocket handshake"
        try:
            await self._write(self._ws.send(Request(host=host, target=resource)))
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

    async def _write(self, data: bytes) -> None:
        """Queue ``data`` behind what is queued and send it all; see the module docstring."""
        out = self._out
        out += data
        try:
            if not self._lock.locked():
                del out[: self._io.send_now(out)]
                if not out:
                    return
            async with self._lock:
                await self._io.flush(out)
        except PeerGone as exc:
            self._drop(f"send failed: {exc or 'the connection broke'}")

    async def keep_alive(self, interval: float) -> None:
        """[edge-liveness] Ping the Edge every quarter ``interval``; return once it has sent nothing
        (not even a pong) for more than ``interval`` seconds, with the connection abandoned. Checkpoints.

        A dead Edge (killed, paused, its host gone) is so noticed between ``interval`` and
        1.25 ``interval`` after its last byte, without a close handshake to wait for.
        """
        while True:
            await trio.sleep(interval / 4)
            silent = trio.current_time() - self.received_at
            if silent > interval:
                logger.warning("the edge sent nothing for %.2f s: dropping the connection", silent)
                self._end(ABNORMAL_CLOSURE, "the edge stopped answering")
                await self._close_transport()
                return
            try:
                await self._send_control(Ping(b""))
            except ConnectionClosed:
                return

    async def _receive(self) -> bytes:
        """Bytes from the socket, b"" at its end (or when it failed). Checkpoints."""
        try:
            data = await self._io.receive_when_readable(RECEIVE_BYTES)
        except PeerGone:
            return b""
        self.received_at = trio.current_time()
        return data

    def _drop(self, why: str) -> NoReturn:
        """The socket failed under a send: close it now and raise (1006 unless a close came first)."""
        self._io.close()
        self._lost(why)

    async def _close_transport(self) -> None:
        self._io.close()
        if self._io.stream is not None:
            await trio.aclose_forcefully(self._io.stream)

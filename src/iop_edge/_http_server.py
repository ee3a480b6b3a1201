"""Serving the ASGI app with hypercorn on our own listener, with a request-head deadline.

hypercorn's ``read_timeout`` bounds each read, so a client trickling its
request head one byte a second never trips it and holds a connection (and a
slot of the server) for as long as it likes. :class:`HeaderDeadlineStream`
closes that hole at the byte-stream level: whenever the connection waits for
a request head -- at open, and again once the server has sent response bytes
-- the first byte received starts a deadline of ``header_timeout`` seconds;
if the blank line ending the head (``\\r\\n\\r\\n``) has not arrived by then,
the connection is closed and the pending read reports end-of-stream, which
hypercorn handles as a client that went away.

hypercorn's public ``serve`` builds its listeners and streams itself, with no
hook for wrapping a stream. So :func:`serve_http` runs ``trio.serve_listeners``
itself and hands each wrapped stream to hypercorn's ``TCPServer`` -- an
internal class (``hypercorn.trio.tcp_server.TCPServer``, with
``WorkerContext``); nothing is pinned, and if its signature changes the
Edge fails at its first connection, loudly. The ASGI lifespan protocol is not
run: :class:`~iop_edge._http_api.EdgeAPI` does nothing on startup/shutdown.
"""

from __future__ import annotations

import logging
import math
from typing import Any, final

import hypercorn.config
import trio
from hypercorn.trio.tcp_server import TCPServer  # internal: see the module docstring
from hypercorn.trio.worker_context import WorkerContext  # internal: see the module docstring
from hypercorn.utils import wrap_app

logger = logging.getLogger("iop_edge.http")

_HEAD_END = b"\r\n\r\n"
_INTERIM = b"HTTP/1.1 1"
"""An interim (1xx) response, e.g. ``100 Continue``: the request it answers is still coming."""


@final
class HeaderDeadlineStream(trio.abc.HalfCloseableStream):
    """A socket stream that fails reads once a request head takes too long.

    Args:
        transport_stream: the accepted connection.
        header_timeout: seconds from the first byte of a request head to its end.

    The head is looked for in the bytes as they arrive (the last three bytes
    are kept across reads). Bytes received while a request body is read or a
    response is streamed are not looked at. A send other than an interim 1xx
    response re-arms the check for the next request head; sending nothing
    while the head is incomplete never stops the deadline.
    """

    def __init__(self, transport_stream: trio.SocketStream, header_timeout: float) -> None:
        self.transport_stream = transport_stream
        self.socket = transport_stream.socket  # hypercorn reads the peer address from it
        self.header_timeout = header_timeout
        self._awaiting_head = True
        self._deadline = math.inf
        self._tail = b""
        self._held_head = b""

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """Receive like the socket stream; checkpoints.

        Returns b"" (end of stream) after closing the connection when a request
        head is in progress and its deadline passed.
        """
        with trio.move_on_at(self._deadline) as scope:
            data = await self.transport_stream.receive_some(max_bytes)
        if scope.cancelled_caught:
            logger.info("client sent no complete request head within %.3g s: disconnecting", self.header_timeout)
            # Close here and report end-of-stream: hypercorn closes a connection whose peer
            # ended it, whereas a read error (its own read_timeout too) leaves the socket
            # open until the keep-alive timeout.
            await self.transport_stream.aclose()
            return b""
        if data and self._awaiting_head:
            self._look_for_head_end(data)
        return data

    def _look_for_head_end(self, data: bytes) -> None:
        if self._deadline == math.inf:
            self._deadline = trio.current_time() + self.header_timeout
        window = self._tail + data
        if _HEAD_END in window:
            self._awaiting_head = False
            self._deadline = math.inf
            self._tail = b""
        else:
            self._tail = window[-3:]

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send like the socket stream; a final response re-arms the head check. Checkpoints.

        Coalescing: a complete response head that announces a non-empty
        ``content-length`` body is held back and goes out with the next write
        (hypercorn writes the head and the body separately: one send -- one
        syscall -- saved per response). The next write always comes: the body,
        or, when the body is suppressed (a HEAD request), the empty write
        hypercorn makes at the end of every message.
        """
        if self._held_head:
            data = self._held_head + data
            self._held_head = b""
        elif _holds_body(data):
            self._held_head = bytes(data)
            return
        await self.transport_stream.send_all(data)
        if not bytes(data[: len(_INTERIM)]) == _INTERIM:
            self._awaiting_head = True
            self._deadline = math.inf
            self._tail = b""

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport_stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        if self._held_head:
            await self.send_all(b"")
        await self.transport_stream.send_eof()

    async def aclose(self) -> None:
        self._held_head = b""  # the connection is going away; a lone head helps no one
        await self.transport_stream.aclose()


def _holds_body(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` is exactly one final response head announcing a body."""
    # Cheap prefix test first: every body chunk of every response passes through here.
    if bytes(data[:9]) != b"HTTP/1.1 ":
        return False
    head = bytes(data)
    if head.startswith(_INTERIM) or not head.endswith(_HEAD_END):
        return False
    start = head.lower().find(b"\r\ncontent-length:")
    if start < 0:
        return False
    end = head.find(b"\r\n", start + 2)
    value = head[start + len(b"\r\ncontent-length:") : end].strip()
    return value.isdigit() and int(value) > 0


async def serve_http(
    app: Any,
    config: hypercorn.config.Config,
    host: str,
    port: int,
    *,
    header_timeout: float,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` (ASGI) over HTTP/1.1 on ``host:port`` until cancelled.

    Reports the bound port through ``task_status`` once listening.
    Checkpoints; cancellation closes the listener and every connection at once.
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    context = WorkerContext(None)

    async def handle(stream: trio.SocketStream) -> None:
        guarded = HeaderDeadlineStream(stream, header_timeout)
        await TCPServer(wrapped, config, context, {}, guarded)  # type: ignore[arg-type]

    task_status.started(listeners[0].socket.getsockname()[1])  # listening already: connections queue
    await trio.serve_listeners(handle, listeners)

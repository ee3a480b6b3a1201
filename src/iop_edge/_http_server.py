"""The Edge's HTTP/1.1 listener: h11 on trio sockets, serving an ASGI-shaped app.

Why not hypercorn: it was ~45 % of the Edge's CPU, and the only way to put a
request-head deadline on its connections was its internal ``TCPServer``. Here
each accepted connection is one task that drives an :class:`h11.Connection`
(the protocol library hypercorn itself uses) and calls the app with an ASGI
``scope``, ``receive`` and ``send`` -- the subset the Edge uses (no lifespan,
no websockets, no HTTP/2). What the listener guarantees:

- **Keep-alive**: a connection serves requests one after another; an idle one
  is closed after ``keep_alive_timeout``.
- **Request-head deadline**: from the first byte of a request head, the client
  has ``header_timeout`` to finish it, at connection start and again after
  each response; otherwise the connection is closed. Heads larger than
  ``max_head_bytes`` are refused (431).
- **Bodies** (content-length or chunked) are read only when the app asks
  (``receive``), each read bounded by ``read_timeout``; ``expect:
  100-continue`` is answered with ``100 Continue`` at that moment, so a request
  rejected before its body is read never makes the client send it. A body the
  app did not read is drained (up to ``DRAIN_LIMIT`` bytes) to keep the
  connection, or the connection closes.
- **Disconnect**: once the body is read, ``receive`` waits for the client to
  go away and then returns ``http.disconnect``.
- **Connection cap**: past ``max_connections`` open connections, a new one is
  closed at once (before a byte is read) -- the cheapest possible refusal.
- A response head goes out with the first body chunk, in one send.

``wrap_stream`` is the seam for TLS: it gets each accepted socket stream and
returns the stream to speak HTTP on (e.g. a ``trio.SSLStream``); it runs under
the head deadline.
"""

from __future__ import annotations

import logging
import math
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, final

import attrs
import h11
import trio

logger = logging.getLogger("iop_edge.http")

Message = MutableMapping[str, Any]
App = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Any]
StreamWrapper = Callable[[trio.SocketStream], Awaitable[trio.abc.Stream]]

DRAIN_LIMIT = 64 * 1024
"""Unread request body bytes the listener reads and drops to keep a connection alive."""

_RECEIVE_SIZE = 65536
_DISCONNECT: Message = {"type": "http.disconnect"}


@attrs.frozen(kw_only=True)
class HttpLimits:
    """The listener's bounds (seconds, bytes, connections)."""

    header_timeout: float
    keep_alive_timeout: float = 75.0
    read_timeout: float = 30.0
    max_head_bytes: int = 64 * 1024
    max_connections: int = 10_000


@final
class ConnectionCounter:
    """Open connections of one listener, and how many were refused at the cap."""

    __slots__ = ("open", "refused", "limit")

    def __init__(self, limit: int) -> None:
        self.open = 0
        self.refused = 0
        self.limit = limit

    def __repr__(self) -> str:
        return f"<ConnectionCounter {self.open}/{self.limit} open, {self.refused} refused>"


class _PeerGone(Exception):
    """The client closed, broke or stalled the connection."""


@final
class _Connection:
    """One HTTP/1.1 connection: reads requests with h11, calls the app for each."""

    def __init__(self, stream: trio.abc.Stream, app: App, limits: HttpLimits) -> None:
        self.stream = stream
        self.app = app
        self.limits = limits
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_head_bytes)
        self.gone = False
        self._head: tuple[int, list[tuple[bytes, bytes]]] | None = None
        self._body_done = False
        self._suppress_body = False
        self._response_started = False

    async def serve(self) -> None:
        """Serve requests until the client leaves, a limit trips or a response says close. Checkpoints."""
        try:
            while True:
                request = await self._next_request()
                if request is None:
                    return
                await self._respond(request)
                if not await self._ready_for_next():
                    return
        except _PeerGone:
            return
        finally:
            await self._close()

    # ------------------------------------------------------------- request heads

    async def _next_request(self) -> h11.Request | None:
        """The next request head, or None when the connection should end."""
        head_deadline = math.inf
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                await self._protocol_error(exc)
                return None
            if event is h11.NEED_DATA:
                if head_deadline == math.inf and self.h11.trailing_data[0]:
                    head_deadline = trio.current_time() + self.limits.header_timeout
                deadline = head_deadline
                if deadline == math.inf:
                    deadline = trio.current_time() + self.limits.keep_alive_timeout
                data = await self._receive(deadline, "request head")
                if data and head_deadline == math.inf:
                    head_deadline = trio.current_time() + self.limits.header_timeout
                self.h11.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                return event
            return None  # ConnectionClosed (or PAUSED after a close)

    async def _receive(self, deadline: float, what: str) -> bytes:
        with trio.move_on_at(deadline):
            try:
                # bytes() returns a plain socket's bytes as they are; TLS gives a bytearray.
                return bytes(await self.stream.receive_some(_RECEIVE_SIZE))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise _PeerGone from None
        if what == "request head" and self.h11.trailing_data[0]:
            logger.info("client sent no complete request head within %.3g s: disconnecting", self.limits.header_timeout)
        raise _PeerGone

    async def _protocol_error(self, exc: h11.RemoteProtocolError) -> None:
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        status = exc.error_status_hint if exc.error_status_hint >= 400 else 400
        body = f"bad request: {exc}".encode()
        headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body)), (b"connection", b"close")]
        try:
            data = self.h11.send(h11.Response(status_code=status, headers=headers))
            data += self.h11.send(h11.Data(data=body)) + self.h11.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            return
        await self._send_bytes(data)

    # -------------------------------------------------------------- the exchange

    async def _respond(self, request: h11.Request) -> None:
        self._head = None
        self._body_done = False
        self._response_started = False
        self._suppress_body = request.method == b"HEAD"
        target = request.target.decode("latin-1")
        path, _, query = target.partition("?")
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version.decode(),
            "method": request.method.decode("ascii"),
            "scheme": "http",
            "path": urllib.parse.unquote(path) if "%" in path else path,
            "raw_path": path.encode("latin-1"),
            "query_string": query.encode("latin-1"),
            "headers": request.headers,
        }
        try:
            await self.app(scope, self._receive_message, self._send_message)
        except Exception:
            logger.exception("error while answering %s %s", scope["method"], path)
            if not self._response_started and not self.gone:
                await self._send_message({"type": "http.response.start", "status": 500, "headers": []})
                await self._send_message({"type": "http.response.body", "body": b"internal error"})
        if self.h11.our_state is h11.SEND_BODY and not self.gone:
            raise _PeerGone  # the app ended a response midway: the client cannot frame it

    async def _receive_message(self) -> Message:
        """ASGI ``receive``: the next body chunk, then (after the body) the client's departure."""
        if self.gone:
            return _DISCONNECT
        if self._body_done:
            return await self._wait_disconnect()
        if self.h11.they_are_waiting_for_100_continue:
            await self._send_bytes(self.h11.send(h11.InformationalResponse(status_code=100, headers=[])))
        try:
            return await self._next_body_message()
        except (_PeerGone, h11.RemoteProtocolError):
            self.gone = True
            return _DISCONNECT

    async def _next_body_message(self) -> Message:
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await self._receive(trio.current_time() + self.limits.read_timeout, "body"))
                continue
            if isinstance(event, h11.Data):
                return self._body_message(bytearray(event.data))
            if isinstance(event, h11.EndOfMessage):
                self._body_done = True
                return {"type": "http.request", "body": b"", "more_body": False}
            raise _PeerGone  # ConnectionClosed mid-body

    def _body_message(self, body: bytearray) -> Message:
        """``body`` plus every chunk already buffered; ``more_body`` false if the end is buffered too."""
        while True:
            event = self.h11.next_event()
            if isinstance(event, h11.Data):
                body += event.data
                continue
            if isinstance(event, h11.EndOfMessage):
                self._body_done = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return {"type": "http.request", "body": bytes(body), "more_body": True}  # NEED_DATA

    async def _wait_disconnect(self) -> Message:
        """Read (and keep, for the next request) until the client goes away."""
        while not self.gone:
            if len(self.h11.trailing_data[0]) > self.limits.max_head_bytes:
                await trio.sleep_forever()  # pipelined too far ahead: stop reading, keep the bytes
            try:
                data = bytes(await self.stream.receive_some(_RECEIVE_SIZE))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self.gone = True
                break
            self.h11.receive_data(data)
        return _DISCONNECT

    async def _send_message(self, message: Message) -> None:
        """ASGI ``send``: the head waits for the first body chunk so both go in one write."""
        if self.gone:
            return
        if message["type"] == "http.response.start":
            self._response_started = True
            self._head = (message["status"], list(message.get("headers", ())))
            return
        body = message.get("body", b"")
        more = message.get("more_body", False)
        parts: list[bytes] = []
        if self._head is not None:
            status, headers = self._head
            self._head = None
            parts.append(self.h11.send(_response(status, headers)) or b"")
        if body and not self._suppress_body:
            parts.append(self.h11.send(h11.Data(data=body)) or b"")
        if not more:
            parts.append(self.h11.send(h11.EndOfMessage()) or b"")
        if parts:
            await self._send_bytes(b"".join(parts))

    async def _send_bytes(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.gone = True

    # ------------------------------------------------------------------- reuse

    async def _ready_for_next(self) -> bool:
        """Whether the connection can carry another request; drains an unread small body."""
        if self.gone or self.h11.our_state is not h11.DONE:
            return False
        if self.h11.their_state is h11.SEND_BODY:
            if self.h11.client_is_waiting_for_100_continue:
                return False
            try:
                drained = 0
                while self.h11.their_state is h11.SEND_BODY and drained <= DRAIN_LIMIT:
                    message = await self._next_body_message()
                    drained += len(message["body"])
            except (_PeerGone, h11.RemoteProtocolError):
                return False
        if self.h11.their_state is not h11.DONE:
            return False
        self.h11.start_next_cycle()
        return True

    async def _close(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()


_RESPONSES: dict[tuple[int, tuple[tuple[bytes, bytes], ...]], h11.Response] = {}
_RESPONSES_MAX = 1024


def _response(status: int, headers: list[tuple[bytes, bytes]]) -> h11.Response:
    """The h11 response event for ``status`` and ``headers``, reused when seen before.

    Building an :class:`h11.Response` validates every header, about 13 % of the
    Edge's CPU under a flood of refusals (py-spy), whose heads repeat. Events are
    immutable, so one can serve every connection. Only error heads (status >= 400)
    are kept, the first ``_RESPONSES_MAX`` distinct ones: a success head carries
    per-request values (queue wait, length) and would only fill the table.
    """
    if status < 400:
        return h11.Response(status_code=status, headers=headers, reason=b"")
    key = (status, tuple(headers))
    event = _RESPONSES.get(key)
    if event is None:
        event = h11.Response(status_code=status, headers=headers, reason=b"")
        if len(_RESPONSES) < _RESPONSES_MAX:
            _RESPONSES[key] = event
    return event


async def serve_http(
    app: App,
    host: str,
    port: int,
    *,
    limits: HttpLimits,
    counter: ConnectionCounter | None = None,
    wrap_stream: StreamWrapper | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` over HTTP/1.1 on ``host:port`` until cancelled.

    Args:
        app: an ASGI-shaped callable ``app(scope, receive, send)`` (HTTP scopes only).
        limits: timeouts and sizes.
        counter: open/refused connections, kept up to date (its ``limit`` is the cap).
        wrap_stream: builds the stream to speak HTTP on from each accepted socket (TLS).

    Reports the bound port through ``task_status`` once listening.
    Checkpoints; cancellation closes the listener and every connection at once.
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    connections = counter if counter is not None else ConnectionCounter(limits.max_connections)

    async def handle(stream: trio.SocketStream) -> None:
        if connections.open >= connections.limit:
            connections.refused += 1
            await trio.aclose_forcefully(stream)
            return
        connections.open += 1
        try:
            http_stream: trio.abc.Stream = stream
            if wrap_stream is not None:
                with trio.move_on_after(limits.header_timeout) as scope:
                    http_stream = await wrap_stream(stream)
                if scope.cancelled_caught:
                    await trio.aclose_forcefully(stream)
                    return
            await _Connection(http_stream, app, limits).serve()
        finally:
            connections.open -= 1

    task_status.started(listeners[0].socket.getsockname()[1])  # listening already: connections queue
    await trio.serve_listeners(handle, listeners)

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
- **Writes never wait on the client**: a plain TCP connection is driven as a
  non-blocking stdlib socket with trio's low-level waits; bytes go to the
  socket at once from whichever task has them (the scope's
  ``iop.write_body_nowait`` lets a relay write body chunks from a node link's
  reader), and what the socket does not take waits in the connection's
  buffer, written by a flusher task. A body chunk is refused past
  ``WRITE_BUFFER_LIMIT`` bytes waiting (the relay then drops the run);
  ASGI ``send`` of a chunk waits only then, the last body message until
  everything is written.
- **Pacing**: an app that sets ``scope[PAUSE_READING]`` to a time on trio's
  clock (the Edge does after a refusal with ``Retry-After``: the client's booked
  return time) gets the connection left unread until then after the response:
  the client's next request waits in the socket buffers, at no CPU cost, and the
  connection counts as *paused*.

``wrap_stream`` is the seam for TLS: it gets each accepted socket stream and
returns the stream to speak HTTP on (e.g. a ``trio.SSLStream``); it runs under
the head deadline. Such a stream is written by the flusher task only (one task
switch per write, as a stream needs).
"""

from __future__ import annotations

import logging
import math
import socket
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

PAUSE_READING = "iop.pause_reading"
"""Scope key: a time on trio's clock before which the connection's next request is not read (pacing)."""


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
    """Open connections of one listener, how many are paused now, how many were refused at the cap."""

    __slots__ = ("open", "paused", "refused", "limit")

    def __init__(self, limit: int) -> None:
        self.open = 0
        self.paused = 0
        self.refused = 0
        self.limit = limit

    def __repr__(self) -> str:
        return f"<ConnectionCounter {self.open}/{self.limit} open, {self.paused} paused, {self.refused} refused>"


class _PeerGone(Exception):
    """The client closed, broke or stalled the connection."""


WRITE_BUFFER_LIMIT = 256 * 1024
"""Bytes waiting for one client past which a body chunk written without waiting is refused."""


class _Transport:
    """The bytes of one client connection, both ways, with an outgoing buffer.

    :meth:`write_nowait` hands bytes to the operating system at once when
    nothing is waiting before them (no task switch); what the socket does not
    take waits in :attr:`pending`, written in order by a flusher task started in
    the connection's nursery. So whoever has bytes for the client (the
    connection's own task, or a node link's reader relaying a run) writes them
    without waiting on the client, and a slow client costs only memory bounded
    by :data:`WRITE_BUFFER_LIMIT`.
    """

    __slots__ = ("pending", "broken", "nursery", "_flushing", "_drained")

    def __init__(self) -> None:
        self.pending = bytearray()
        self.broken = False
        self.nursery: trio.Nursery | None = None  # set by the connection before any write
        self._flushing = False
        self._drained = trio.Event()

    def write_nowait(self, data: bytes) -> bool:
        """Write ``data`` after what is pending (never waits).

        Returns:
            False when the bytes waiting for the client exceed
            :data:`WRITE_BUFFER_LIMIT` (``data`` is kept all the same).
            A broken connection takes and drops everything.
        """
        if self.broken:
            return True
        if not self._flushing:
            try:
                sent = self._send_now(data)
            except _PeerGone:
                self.broken = True
                return True
            if sent == len(data):
                return True
            self.pending += memoryview(data)[sent:]
            self._flushing = True
            self._drained = trio.Event()
            assert self.nursery is not None
            self.nursery.start_soon(self._flush_pending)
            return len(self.pending) <= WRITE_BUFFER_LIMIT
        self.pending += data
        return len(self.pending) <= WRITE_BUFFER_LIMIT

    async def send_all(self, data: bytes) -> None:
        """Write ``data`` and wait until every pending byte is written (or the client is gone).

        Checkpoints only when the socket did not take everything at once.
        Cancelled, the bytes stay pending and are still written in order.
        """
        self.write_nowait(data)
        if self._flushing:
            await self._drained.wait()

    async def wait_below_limit(self) -> None:
        """Wait while more than :data:`WRITE_BUFFER_LIMIT` bytes wait for the client.

        Checkpoints only when it waits.
        """
        while self._flushing and len(self.pending) > WRITE_BUFFER_LIMIT:
            await self._drained.wait()

    async def _flush_pending(self) -> None:
        try:
            await self._flush()
        except _PeerGone:
            self.broken = True
            self.pending.clear()
        finally:
            self._flushing = False
            self._drained.set()

    def _send_now(self, data: bytes) -> int:
        """Bytes of ``data`` the connection took without waiting (raises :class:`_PeerGone`)."""
        raise NotImplementedError

    async def _flush(self) -> None:
        """Write :attr:`pending` until it is empty, waiting as needed (raises :class:`_PeerGone`)."""
        raise NotImplementedError

    async def receive_some(self) -> bytes:
        """The next bytes from the client; ``b""`` at its end (raises :class:`_PeerGone`). Checkpoints."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Close the connection. Checkpoints."""
        raise NotImplementedError


@final
class _SocketTransport(_Transport):
    """A plain TCP connection, driven as a non-blocking stdlib socket with trio's low-level waits.

    Writing a body chunk is then one ``send`` system call from the task that has
    the bytes; trio's ``SocketStream.send_all`` always reschedules its task too.
    """

    __slots__ = ("sock",)

    def __init__(self, stream: trio.SocketStream) -> None:
        super().__init__()
        self.sock = socket.socket(fileno=stream.socket.detach())
        self.sock.setblocking(False)

    def _send_now(self, data: bytes) -> int:
        try:
            return self.sock.send(data)
        except BlockingIOError:
            return 0
        except OSError:
            raise _PeerGone from None

    async def _flush(self) -> None:
        pending = self.pending
        while pending:
            await trio.lowlevel.wait_writable(self.sock)
            try:
                sent = self.sock.send(pending)
            except BlockingIOError:
                continue
            except OSError:
                raise _PeerGone from None
            del pending[:sent]

    async def receive_some(self) -> bytes:
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            try:
                data = self.sock.recv(_RECEIVE_SIZE)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)
                waited = True
                continue
            except OSError:
                raise _PeerGone from None
            if not waited:
                await trio.lowlevel.cancel_shielded_checkpoint()  # a schedule point, as trio's streams
            return data

    async def aclose(self) -> None:
        self.broken = True
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()
        await trio.lowlevel.checkpoint()


@final
class _StreamTransport(_Transport):
    """A connection spoken through a trio stream (TLS: a ``trio.SSLStream``); the flusher writes."""

    __slots__ = ("stream",)

    def __init__(self, stream: trio.abc.Stream) -> None:
        super().__init__()
        self.stream = stream

    def _send_now(self, data: bytes) -> int:
        return 0  # a stream is written only by awaiting it: the flusher does

    async def _flush(self) -> None:
        while self.pending:
            data = bytes(self.pending)
            self.pending.clear()
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise _PeerGone from None

    async def receive_some(self) -> bytes:
        try:
            # bytes() returns a plain socket's bytes as they are; TLS gives a bytearray.
            return bytes(await self.stream.receive_some(_RECEIVE_SIZE))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise _PeerGone from None

    async def aclose(self) -> None:
        self.broken = True
        await self.stream.aclose()


@final
class _Connection:
    """One HTTP/1.1 connection: reads requests with h11, calls the app for each."""

    def __init__(self, transport: _Transport, app: App, limits: HttpLimits, counter: ConnectionCounter) -> None:
        self.transport = transport
        self.app = app
        self.limits = limits
        self.counter = counter
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_head_bytes)
        self.gone = False
        self._head: tuple[int, list[tuple[bytes, bytes]]] | None = None
        self._body_done = False
        self._suppress_body = False
        self._response_started = False

    async def serve(self) -> None:
        """Serve requests until the client leaves, a limit trips or a response says close. Checkpoints."""
        async with trio.open_nursery() as nursery:
            self.transport.nursery = nursery  # where a flusher runs when the client is behind
            try:
                while True:
                    request = await self._next_request()
                    if request is None:
                        return
                    until = await self._respond(request)
                    if not await self._ready_for_next():
                        return
                    if until > trio.current_time():
                        await self._pause(until)
            except _PeerGone:
                return
            finally:
                nursery.cancel_scope.cancel()
                await self._close()

    # ------------------------------------------------------------- request heads

    async def _next_request(self) -> h11.Request | None:
        """The next request head, or None when the connection should end."""
        head_deadline = math.inf
        received = False
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                await self._protocol_error(exc)
                return None
            if event is h11.NEED_DATA:
                received = True
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
                if not received:
                    await trio.lowlevel.checkpoint()  # a pipelined head: still one schedule point per request
                return event
            return None  # ConnectionClosed (or PAUSED after a close)

    async def _receive(self, deadline: float, what: str) -> bytes:
        with trio.move_on_at(deadline):
            return await self.transport.receive_some()
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

    async def _pause(self, until: float) -> None:
        """Leave the connection unread until ``until`` (trio's clock; pacing); counted as paused meanwhile."""
        self.counter.paused += 1
        try:
            await trio.sleep_until(until)
        finally:
            self.counter.paused -= 1

    async def _respond(self, request: h11.Request) -> float:
        """Call the app for ``request``; returns when the next request may be read (``PAUSE_READING``)."""
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
            "extensions": {"iop.write_body_nowait": self._write_body_nowait},
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
        until: float = scope.get(PAUSE_READING, -math.inf)
        return until

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
                data = await self.transport.receive_some()
            except _PeerGone:
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
        if not parts:
            return
        if more:  # a body chunk: written at once, waiting only for a client far behind
            self.transport.write_nowait(b"".join(parts))
            await self.transport.wait_below_limit()
        else:
            await self._send_bytes(b"".join(parts))
        if self.transport.broken:
            self.gone = True

    def _write_body_nowait(self, data: bytes) -> bool:
        """Write a chunk of the response body now, from any task (never waits).

        The ``iop.write_body_nowait`` extension of the scope: for a relay that
        gets the bytes in another task (a node link's reader) and wants them on
        the socket without a task switch. Call it only between the response
        head and the last body message, with nothing else writing meanwhile.

        Returns:
            False when the client is too far behind (more than
            :data:`WRITE_BUFFER_LIMIT` bytes wait for it); the chunk is kept.
            Bytes for a client that is gone are dropped (True).
        """
        if self.gone or self._suppress_body or self.h11.our_state is not h11.SEND_BODY:
            return True
        try:
            framed = self.h11.send(h11.Data(data=data)) or b""
        except h11.LocalProtocolError:  # more than a content-length said: the response cannot go on
            self.gone = True
            return False
        return self.transport.write_nowait(framed)

    async def _send_bytes(self, data: bytes) -> None:
        await self.transport.send_all(data)
        if self.transport.broken:
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
            await self.transport.aclose()


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
            transport = _SocketTransport(stream) if wrap_stream is None else _StreamTransport(http_stream)
            await _Connection(transport, app, limits, connections).serve()
        finally:
            connections.open -= 1

    task_status.started(listeners[0].socket.getsockname()[1])  # listening already: connections queue
    await trio.serve_listeners(handle, listeners)

"""The Edge's HTTP/1.1 listener: :mod:`iop_http`'s request reader on trio sockets, serving an ASGI-shaped app.

**Framing** (:mod:`iop_http`): each connection has one :class:`iop_http.RequestReader`,
fed every byte the client sends once: llhttp (``httptools``) parses the requests and
the reader adds the project's rules where llhttp is more permissive (``docs/security.md``).
A refusal (400, 431, 501, 505) is a fixed text answered with ``connection:
close``, and the connection ends. Every answer is written by :mod:`iop_http`'s
encoders (:mod:`.cycle`): no second parser reads the same bytes.

Why not hypercorn: its layers took most of the Edge's CPU, and the only way to put a
request-head deadline on its connections was its internal ``TCPServer``. Here
each accepted connection is one task that reads its requests and calls the app with an ASGI
``scope``, ``receive`` and ``send`` -- the subset the Edge uses (no lifespan,
no websockets, no HTTP/2). What the listener guarantees:

- **Keep-alive**: a connection serves requests one after another, each answer
  written whole before the next; an idle one is closed after ``keep_alive_timeout``.
  An app call whose answer is out may finish its work (its tail) while the next
  requests are served in another task of the connection, one tail at a time
  (:meth:`~.cycle.RequestCycle.serve_next_meanwhile`).
- **Request-head deadline**: from the first byte of a request head, the client
  has ``header_timeout`` to finish it, at connection start and again after
  each response; otherwise the connection is closed. Heads larger than
  ``max_head_bytes`` are refused (431).
- **Bodies** (content-length or chunked) are read only when the app asks
  (``receive``), each read bounded by ``read_timeout``; ``expect:
  100-continue`` is answered with ``100 Continue`` at that moment, so a request
  rejected before its body is read never makes the client send it (and the
  connection then closes). An answer sent before the body was read decides on its head
  whether the connection goes on: after a refusal (400 or more) only when the body had
  arrived whole (it is skipped); after a success when what is left fits the drain
  (``DRAIN_LIMIT`` bytes). Otherwise the head says ``connection: close`` (RFC 9112 9.6)
  and the close lingers (``linger_timeout``): the client may finish sending and then
  read the answer, which a reset would destroy.
- **Disconnect** and **writes that never wait on the client**: see :mod:`._http_cycle`.
- **Accept**: each wake-up of the listener accepts every connection waiting (up to
  :data:`ACCEPT_BATCH`), not one per scheduling round (:mod:`iop_io.accept`).
- **Connection cap**: past ``max_connections`` open connections, a new one is
  closed at once (before a byte is read) -- the cheapest possible refusal.
- A response head goes out with the first body chunk, in one send.
- **Pacing and refusals on the head**: see :mod:`._http_head_desk`.

**Rooms**: :class:`_Connection` is the serve loop: it owns the socket's transport and its request
reader, reads each request head, and answers framing refusals. :class:`~._http_head_desk.HeadDesk`
asks ``refuse_head``, answers refusals and keeps a paused connection (:mod:`._http_pacing`'s
:class:`Pacer`). One :class:`~._http_cycle.RequestCycle` per request let through calls the app with
its ASGI ``receive``/``send`` and :class:`~._http_cycle.ConnectionHooks`. The disconnect watch is
:mod:`._http_disconnects`; the transport and the accept loop are :mod:`iop_io`'s (shared with the mock).

``wrap_stream`` is the seam for TLS: it gets each accepted socket stream and
returns the stream to speak HTTP on (e.g. a ``trio.SSLStream``); it runs under
the head deadline. Such a stream is written by the flusher task only (one task
switch per write, as a stream needs). Its close is bounded by ``close_timeout``
(a TLS ``close_notify`` to a client that reads nothing), then forced.
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Awaitable, Callable
from typing import final

import attrs
import trio

from iop_edge.listener.cycle import HANDED_OVER, App, CycleHost, HandedOver, RequestCycle
from iop_edge.listener.disconnects import DisconnectPoller, DisconnectWatcher, PolledWatch
from iop_edge.listener.head_desk import HeadDesk, HeadRefuser
from iop_edge.listener.pacing import Headers, Pacer
from iop_http import (
    CLOSED,
    MAX_CHUNK_EXTENSION_BYTES,
    NEED_DATA,
    Refusal,
    RequestHead,
    RequestReader,
    encode_response,
    error_response,
)
from iop_io import CAN_POLL, CLOSE_TIMEOUT, PeerGone, SocketTransport, StreamTransport, Transport, accept_loop

logger = logging.getLogger("iop_edge.http")

LINGER_BYTES = 1 << 20
"""The most bytes a lingering close reads and drops (:attr:`HttpLimits.linger_timeout`)."""

StreamWrapper = Callable[[trio.SocketStream], Awaitable[trio.abc.Stream]]


@attrs.frozen(kw_only=True)
class HttpLimits:
    """The listener's bounds (seconds, bytes, connections)."""

    header_timeout: float
    keep_alive_timeout: float = 75.0
    read_timeout: float = 30.0
    max_head_bytes: int = 64 * 1024
    max_chunk_extension_bytes: int = MAX_CHUNK_EXTENSION_BYTES
    max_connections: int = 10_000
    close_timeout: float = CLOSE_TIMEOUT
    """Seconds a graceful close (TLS ``close_notify``) may take before the connection is dropped."""
    linger_timeout: float = 2.0
    """Seconds a close after an answer to an unread request body waits for the client to end its side
    (:data:`LINGER_BYTES` at most read and dropped meanwhile), as Apache's lingering close."""


@final
class ConnectionCounter:
    """Open connections of one listener, how many are paused now, how many were refused at the cap,
    and how many run a request's tail while serving their next requests (at most one each)."""

    __slots__ = ("open", "paused", "refused", "tails", "limit")

    def __init__(self, limit: int) -> None:
        self.open = 0
        self.paused = 0
        self.refused = 0
        self.tails = 0
        self.limit = limit

    def __repr__(self) -> str:
        return (
            f"<ConnectionCounter {self.open}/{self.limit} open, {self.paused} paused, {self.refused} refused,"
            f" {self.tails} tails>"
        )


@final
class CannedResponse:
    """A whole response (head and body) that :mod:`iop_http` encodes once; answering with it is one ``send``.

    Args:
        status: the status code.
        headers: the response headers, a ``content-length`` among them.
        body: the body.
        retry_after: the ``Retry-After`` among the headers, in seconds, if any: the pacer
            looks at a paused connection again when its client was told to come back.

    ``keep_alive`` and ``closing`` are the bytes on the wire after a request
    that keeps the connection open or must close it (the latter with
    ``connection: close``).
    """

    __slots__ = ("status", "headers", "body", "retry_after", "keep_alive", "closing")

    def __init__(self, status: int, headers: Headers, body: bytes, retry_after: float | None = None) -> None:
        self.status = status
        self.headers = list(headers)
        self.body = body
        self.retry_after = retry_after
        self.keep_alive = encode_response(status, self.headers, body)
        self.closing = encode_response(status, self.headers, body, close=True)

    def __repr__(self) -> str:
        return f"<CannedResponse {self.status}, {len(self.keep_alive)} bytes>"


@final
class _Connection:
    """One HTTP/1.1 connection: reads requests with its :class:`iop_http.RequestReader`, calls the app for each."""

    def __init__(
        self,
        transport: Transport,
        app: App,
        limits: HttpLimits,
        counter: ConnectionCounter,
        pacer: Pacer,
        refuse_head: HeadRefuser | None = None,
        disconnects: DisconnectPoller | None = None,
    ) -> None:
        self.transport = transport
        self.app = app
        self.limits = limits
        self.counter = counter
        self.pacer = pacer
        self.refuse_head = refuse_head
        self.disconnects = disconnects
        """The listener's disconnect poller (Linux); None: the connection watches with a task of its own."""
        self.reader = RequestReader(limits.max_head_bytes, limits.max_chunk_extension_bytes)
        """The connection's requests, from every byte its client sends (read once)."""
        self.gone = False
        self.lingers = False
        """An answer went out before its request body was read to the end: the close lingers (:meth:`_close`)."""
        self._resumed = False  # woken from a pause: the next read need not be a schedule point
        self.desk = HeadDesk(self, counter, pacer, refuse_head)
        """The head refusals and pauses of this connection."""
        self.watcher: DisconnectWatcher | PolledWatch | None = None
        """The connection's disconnect watch, made by the first request that asks for one."""
        self.tail = False
        """A request's app call runs on after its response while the next requests are served (at most one)."""
        host: CycleHost = self  # mypy checks the contract here
        del host

    async def serve(self) -> None:
        """Serve requests until the client leaves, a limit trips or a response says close. Checkpoints."""
        try:
            async with trio.open_nursery() as nursery:
                self.transport.nursery = nursery  # where a flusher runs when the client is behind
                try:
                    if not await self.serve_requests(-math.inf):
                        # A request's tail runs (or ran) here; the next requests are served in another
                        # task, which cancels the nursery when the connection ends.
                        await trio.sleep_forever()
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            await self._close()

    async def serve_requests(self, until: float) -> bool:
        """Serve requests in this task (the next one read from ``until`` on) until the connection ends
        (then True, the connection's nursery cancelled: a tail still running stops) or a request's app
        call hands the next requests to another task to finish its tail here (then False, once the
        tail is over: :meth:`~.cycle.RequestCycle.serve_next_meanwhile`). Checkpoints."""
        try:
            while True:
                if until > trio.current_time():
                    await self.desk.pause(until)
                    self._resumed = True  # the wake-up was this request's schedule point
                    if self.gone:
                        return self._end()
                request = await self._next_request()
                if request is None:
                    return self._end()
                answered = await self._answer(request)
                if answered is None:
                    return self._end()
                if answered is HANDED_OVER:
                    return False
                until = answered
        except PeerGone:
            return self._end()

    def hand_over(self, until: float) -> bool:
        """Serve the next requests (from ``until`` on) in another task while the calling request's app
        call finishes its tail in this one; False, nothing done, while another tail runs. Never waits."""
        if self.tail or self.transport.nursery is None:
            return False
        self.tail = True
        self.counter.tails += 1
        self.transport.nursery.start_soon(self.serve_requests, until)
        return True

    def tail_ended(self) -> None:
        """The tail of :meth:`hand_over` is over: the next request may have one."""
        self.tail = False
        self.counter.tails -= 1

    def _end(self) -> bool:
        """The connection ends: its nursery is cancelled (the flusher, the watcher, a tail). True."""
        assert self.transport.nursery is not None
        self.transport.nursery.cancel_scope.cancel()
        return True

    # ------------------------------------------------------------- request heads

    async def _next_request(self) -> RequestHead | None:
        """The next request head, or None when the connection should end (a refusal answered).

        Reads until the reader has the next head, the head deadline running from its first byte:
        ``header_timeout`` to finish it, ``keep_alive_timeout`` for the first byte to come.
        """
        head_deadline = math.inf
        scheduled = self._resumed  # a schedule point passed for this request (a pause's wake-up)
        self._resumed = False
        reader = self.reader
        while True:
            event = reader.next_event()
            if event is NEED_DATA:
                if reader.buffered and head_deadline == math.inf:
                    head_deadline = trio.current_time() + self.limits.header_timeout
                self.desk.unparsed = None  # the reader now holds more than the bytes read on the pause's end
                # Bytes already there (a keep-alive client's next request usually is, by the time the
                # previous one is done) are read without a timer; the schedule point follows the head.
                data = self.transport.receive_nowait()
                if data is None:
                    deadline = head_deadline
                    if deadline == math.inf:
                        deadline = trio.current_time() + self.limits.keep_alive_timeout
                    data = await self.receive(deadline, "request head")
                    scheduled = True
                if data and head_deadline == math.inf:
                    head_deadline = trio.current_time() + self.limits.header_timeout
                reader.feed(data)
                continue
            if type(event) is RequestHead:
                if not scheduled:
                    await trio.lowlevel.checkpoint()  # read without waiting: still one schedule point per request
                return event
            if type(event) is Refusal:
                await self.refuse_bytes(event)
            else:  # CLOSED: the client ended its side (between requests or mid-head), or may send nothing more
                assert event is CLOSED, event
            return None

    async def refuse_bytes(self, refusal: Refusal) -> None:
        """Answer a request refused on its framing (fixed text) and end the connection."""
        self.gone = True
        await self.transport.send_all(error_response(refusal))

    async def receive(self, deadline: float, what: str) -> bytes:
        with trio.move_on_at(deadline):
            return await self.transport.receive_some()
        if what == "request head" and self.reader.buffered:
            logger.info("client sent no complete request head within %.3g s: disconnecting", self.limits.header_timeout)
        raise PeerGone

    # -------------------------------------------------------------- the exchange

    async def _answer(self, request: RequestHead) -> float | HandedOver | None:
        """Answer ``request``: refused on its head, or through the app.

        Returns:
            The time before which the next request is not read, None when
            the connection cannot carry another request, or :data:`HANDED_OVER`
            when another task serves the next requests (this one ran the request's tail).
        """
        desk = self.desk
        unparsed, desk.unparsed = desk.unparsed, None
        decided, desk.let_through = desk.let_through and unparsed is not None, False
        asked = self.refuse_head is not None and request.method != b"HEAD"
        if asked and not decided:
            refused = desk.decide(request.method, request.path, request.headers)
            if refused is not None:
                return await desk.refuse(*refused, request, unparsed)
        cycle = RequestCycle(self, request, asked)
        until = await cycle.respond()
        if cycle.handed_over:
            return HANDED_OVER
        return until if await cycle.ready_for_next() else None

    def keep_read(self, data: bytes) -> bool:
        """Keep bytes the disconnect watch read (a pipelined next request) for the next request; whether
        to go on watching (no: past ``max_head_bytes`` of them, the rest stays in the socket)."""
        self.reader.feed(data)
        return self.reader.buffered <= self.limits.max_head_bytes

    async def send_bytes(self, data: bytes) -> None:
        """Write ``data`` and wait until it is out (or the client is gone)."""
        await self.transport.send_all(data)
        if self.transport.broken:
            self.gone = True

    async def _close(self) -> None:
        """Close the transport, even when cancelled; bounded (``HttpLimits.close_timeout``), lingering
        first (``HttpLimits.linger_timeout``) when the client may still be sending a request body."""
        try:
            if self.lingers and not self.transport.broken:
                await self._linger()
        finally:
            with trio.CancelScope(shield=True):
                await self.transport.aclose()

    async def _linger(self) -> None:
        """RFC 9112 9.6's staged close: end this side (FIN), then read and drop what the client still
        sends until it ends its side, for at most ``linger_timeout`` seconds and ``LINGER_BYTES``. A
        socket closed with unread bytes sends a reset, and a reset can destroy the answer before the
        client reads it (an answer to a request whose body was still coming: 413, 401, 429)."""
        if not isinstance(self.transport, SocketTransport):
            return  # a TLS stream's close_notify ends it; its reader is the stream's
        io = self.transport.io
        io.end_sending()
        left = LINGER_BYTES
        with trio.move_on_after(self.limits.linger_timeout):
            while left > 0:
                try:
                    data = await self.transport.receive_some()
                except PeerGone:
                    return
                if not data:
                    return
                left -= len(data)


@final
@attrs.frozen
class _Listener:
    """What every connection of one listener shares; :meth:`handle` serves one accepted connection."""

    app: App
    limits: HttpLimits
    connections: ConnectionCounter
    pacer: Pacer
    disconnects: DisconnectPoller | None
    wrap_stream: StreamWrapper | None
    refuse_head: HeadRefuser | None

    async def handle(self, stream: trio.SocketStream) -> None:
        """Serve ``stream`` from accept to close: closed at once past the connection cap, wrapped
        (TLS) within the head timeout, then served. Checkpoints."""
        connections = self.connections
        if connections.open >= connections.limit:
            connections.refused += 1
            await trio.aclose_forcefully(stream)
            return
        connections.open += 1
        try:
            transport: Transport
            if self.wrap_stream is None:
                transport = SocketTransport(stream)
            else:
                with trio.move_on_after(self.limits.header_timeout) as scope:
                    transport = StreamTransport(await self.wrap_stream(stream), self.limits.close_timeout)
                if scope.cancelled_caught:
                    await trio.aclose_forcefully(stream)
                    return
            connection = _Connection(
                transport, self.app, self.limits, connections, self.pacer, self.refuse_head, self.disconnects
            )
            await connection.serve()
        finally:
            connections.open -= 1


async def serve_http(
    app: App,
    host: str,
    port: int,
    *,
    limits: HttpLimits,
    counter: ConnectionCounter | None = None,
    wrap_stream: StreamWrapper | None = None,
    refuse_head: HeadRefuser | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` over HTTP/1.1 on ``host:port`` until cancelled.

    Args:
        app: an ASGI-shaped callable ``app(scope, receive, send)`` (HTTP scopes only).
        limits: timeouts and sizes.
        counter: open/refused connections, kept up to date (its ``limit`` is the cap).
        wrap_stream: builds the stream to speak HTTP on from each accepted socket (TLS).
        refuse_head: asked on each request head whether to refuse it at once (see the module).

    Reports the bound port through ``task_status`` once listening.
    Checkpoints; cancellation closes the listener and every connection at once.
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    connections = counter if counter is not None else ConnectionCounter(limits.max_connections)
    pacer = Pacer()
    disconnects = DisconnectPoller() if CAN_POLL else None
    handle = _Listener(app, limits, connections, pacer, disconnects, wrap_stream, refuse_head).handle
    bound = listeners[0].socket.getsockname()[1]
    sockets = [socket.socket(fileno=listener.socket.detach()) for listener in listeners]
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pacer.run)
            if disconnects is not None:
                nursery.start_soon(disconnects.run)
            for sock in sockets:
                sock.setblocking(False)
                nursery.start_soon(accept_loop, sock, nursery, handle)
            task_status.started(bound)  # listening already: connections queue
    finally:
        for sock in sockets:
            sock.close()

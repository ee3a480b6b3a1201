"""The Edge's HTTP/1.1 listener: h11 on trio sockets, serving an ASGI-shaped app.

**Framing** (:mod:`iop_http`): every request head is accepted or refused by
:func:`iop_http.accept_head` before any parser frames it, and a chunked body
is checked by :class:`iop_http.ChunkedBody` as it is read. The module's rules
are stricter than h11's (``Content-Length`` beside ``Transfer-Encoding``,
obs-fold, bare CR/LF, ``Content-Length`` spellings, chunk sizes past 2**64),
so h11, reading only heads the module accepted, frames them the same way. A
refusal (400, 431, 501, 505) is a fixed text answered with ``connection:
close``, and the connection ends.

**The plain lane** (:mod:`._plain_http`): a request that arrives whole in one
read on a connection with nothing else buffered (a keep-alive client's small
POST, the usual case) and is plain (HTTP/1.1, keep-alive, a ``content-length``
body, no ``expect``, nothing after it) is read by :mod:`iop_http` alone, and a
whole answer with a ``content-length`` is written as the bytes h11 writes for
it; any other answer to it (a stream, an odd header) hands the request's bytes
to h11 first, which answers it as any other. Every other request goes through
h11 as below. Driving h11 for such an exchange was about a sixth of the Edge's
CPU per request at concurrency 64.

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
  rejected before its body is read never makes the client send it (and the
  connection then closes). After a refusal (400 or more) the connection is kept
  only when the body had arrived whole; after a success an unread body is
  drained (up to ``DRAIN_LIMIT`` bytes) to keep the connection, or the
  connection closes.
- **Disconnect**: once the body is read, ``receive`` waits for the client to
  go away and then returns ``http.disconnect``. On a plain TCP connection the
  scope's ``cancel_on_disconnect(cancel_scope)`` (:class:`ConnectionHooks`) does the same watching
  without a task per request: the listener's one disconnect poller (an epoll
  set of its own, Linux; elsewhere one watcher task per connection, parked
  between requests) cancels ``cancel_scope`` if the client goes away before
  the app returns, or before the app's whole response went out through
  ``respond_nowait`` (bytes of a next request read meanwhile are kept
  for it).
- **Accept**: each wake-up of the listener accepts every connection waiting
  (up to :data:`ACCEPT_BATCH`), where ``trio.serve_listeners`` accepts one per
  scheduling round: when hundreds of clients connect within a second to a busy
  Edge, a round lasts milliseconds and the last of them waited seconds for their
  accept (:mod:`._http_accept`).
- **Connection cap**: past ``max_connections`` open connections, a new one is
  closed at once (before a byte is read) -- the cheapest possible refusal.
- A response head goes out with the first body chunk, in one send.
- **Writes never wait on the client**: a plain TCP connection is driven as a
  non-blocking stdlib socket with trio's low-level waits; bytes go to the
  socket at once from whichever task has them (the scope's
  ``write_body_nowait`` lets a relay write body chunks from a node link's
  reader, ``respond_nowait`` a whole response), and what the socket does
  not take waits in the connection's
  buffer, written by a flusher task. A body chunk is refused past
  ``WRITE_BUFFER_LIMIT`` bytes waiting (the relay then drops the run);
  ASGI ``send`` of a chunk waits only then, the last body message until
  everything is written.
- **Pacing**: an app that sets ``scope[PAUSE_READING]`` to a time on trio's
  clock (the Edge does after a refusal with ``Retry-After``: the client's booked
  return time) gets the connection left unread until then after the response:
  the client's next request waits in the socket buffers, at no CPU cost, and the
  connection counts as *paused*. A pause is a place in the listener's queue of
  paused connections, not a timer of its own: one task wakes them when due.
- **Refusals on the head** (``refuse_head``): for each request head, before a
  scope is built or the app called, the listener asks ``refuse_head(method,
  target, headers)``; when it returns a :class:`CannedResponse` and a pause time,
  that response goes out as bytes iop_http encoded once, the body (if the client sent
  it whole) is skipped, and the connection is paced as above. When a paused
  connection is due, the pacer's task reads it itself: if what the client sent
  is, byte for byte, a whole request h11 parsed and the listener refused before
  (a flood's retries repeat), ``refuse_head`` is asked again on that request's
  head, and a refusal goes out and the connection is paused again, all without
  waking the connection's task or parsing the bytes again; anything else is
  handed to the connection's task (a remembered request let through there is
  not asked about again: its task calls the app at once, with the scope
  hooks' ``head_let_through`` set, as for every request ``refuse_head``
  let through). A connection with nothing to read yet is
  looked at again by the pacer (:data:`RECHECK_AFTER`, up to :data:`RECHECKS`
  times, and once after the time its client was told to come back, when a
  :class:`CannedResponse` says) before its task waits for the socket. A refused retry under a flood
  thus costs a ``recv``, a dictionary look-up, the decision and one ``send``.

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
from typing import Any, Final, Protocol, final

import attrs
import h11
import trio

from iop_http import (
    CHUNKED,
    ChunkedBody,
    MalformedChunk,
    Refusal,
    RequestHead,
    accept_head,
    encode_chunk,
    encode_response,
    error_response,
    find_head_end,
    head_too_large,
)

from ._http_accept import accept_loop
from ._http_disconnects import CAN_POLL, DisconnectPoller, DisconnectWatcher, PolledWatch
from ._http_pacing import PACING_QUANTUM, RECHECKS, TOLD_GRACE, Headers, Pacer, step_after
from ._http_transport import CLOSE_TIMEOUT, PeerGone, SocketTransport, StreamTransport, Transport
from ._plain_http import PlainRequest, parse_plain, plain_response

_MALFORMED_CHUNKS: Final = Refusal(400, "malformed chunked body")
_UNREADABLE: Final = Refusal(400, "malformed request head")

logger = logging.getLogger("iop_edge.http")

Message = MutableMapping[str, Any]
App = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Any]
StreamWrapper = Callable[[trio.SocketStream], Awaitable[trio.abc.Stream]]

DRAIN_LIMIT = 64 * 1024
"""Unread request body bytes the listener reads and drops to keep a connection alive."""

RECEIVE_SIZE = 65536
_DISCONNECT: Message = {"type": "http.disconnect"}

PAUSE_READING = "iop.pause_reading"
"""Scope key: a time on trio's clock before which the connection's next request is not read (pacing)."""

CONNECTION = "iop.connection"
"""Scope extension: the listener's :class:`ConnectionHooks` for this request (its one key in the scope)."""


class ConnectionHooks(Protocol):
    """What the listener offers the app beyond ASGI for one request: the out-of-band writes, the
    disconnect hook and what ``refuse_head`` decided. The scope's ``extensions[CONNECTION]``."""

    @property
    def head_let_through(self) -> bool:
        """The listener asked ``refuse_head`` on this request's head and it let it through."""
        ...

    @property
    def can_watch_disconnect(self) -> bool:
        """:meth:`cancel_on_disconnect` is available (a plain TCP connection)."""
        ...

    def write_body_nowait(self, data: bytes) -> bool:
        """Write a chunk of the response body now, from any task; False when the client is too far behind."""
        ...

    def respond_nowait(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """Write a whole response now, from any task; False when nothing was written."""
        ...

    def cancel_on_disconnect(self, cancel_scope: trio.CancelScope) -> None:
        """Cancel ``cancel_scope`` if the client goes away before the app returns."""
        ...


@attrs.frozen(kw_only=True)
class HttpLimits:
    """The listener's bounds (seconds, bytes, connections)."""

    header_timeout: float
    keep_alive_timeout: float = 75.0
    read_timeout: float = 30.0
    max_head_bytes: int = 64 * 1024
    max_connections: int = 10_000
    close_timeout: float = CLOSE_TIMEOUT
    """Seconds a graceful close (TLS ``close_notify``) may take before the connection is dropped."""


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
    ``connection: close``, as h11 writes it).
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


HeadRefuser = Callable[[bytes, bytes, Headers], "tuple[CannedResponse, float] | None"]
"""``refuse_head(method, target, headers)``: ``(response, pause until)`` to refuse a request on its head, or None."""


@final
class _Connection:
    """One HTTP/1.1 connection: reads requests with h11, calls the app for each."""

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
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_head_bytes)
        self.gone = False
        self._resumed = False  # woken from a pause: the next read need not be a schedule point
        self._unparsed: bytes | None = None  # all the bytes h11 holds, read whole on a pause's end
        self._let_through = False  # refuse_head let those bytes' request through already
        self._rechecks = 0  # times the pacer found nothing to read since the pause's end
        self._idle = False  # the pacer gave up looking: the task waits for the client's bytes
        self._plain = isinstance(transport, SocketTransport)  # a pause's end may be answered without the task
        self._told = -math.inf  # when the last refused client was told to come back (Retry-After)
        self._head: tuple[int, list[tuple[bytes, bytes]]] | None = None
        self._plain_request: PlainRequest | None = None  # the request in the plain lane (h11 has not seen it)
        self._plain_answered = False  # its whole answer went out in the plain lane
        self._request_head: RequestHead | None = None  # iop_http's reading of the request in hand
        self._chunks: ChunkedBody | None = None  # checks a chunked request body's framing as it is read
        self._chunks_pending = b""  # the start of a chunk line not whole yet
        self._continued = False  # 100 Continue went out for the request in hand
        self._status = 0  # the status of the response in hand, once its head is encoded
        self._body_done = False
        self._suppress_body = False
        self._response_started = False
        self._chunked = False  # h11 frames this response's body as chunks: later ones are framed alike
        self._watcher: DisconnectWatcher | PolledWatch | None = None
        self.head_let_through = False
        """:class:`ConnectionHooks`: ``refuse_head`` let the request in hand through."""
        self.can_watch_disconnect = isinstance(transport, SocketTransport)
        """:class:`ConnectionHooks`: :meth:`cancel_on_disconnect` is available."""
        hooks: ConnectionHooks = self  # mypy checks the contract here
        self._extensions: dict[str, Any] = {CONNECTION: hooks}

    async def serve(self) -> None:
        """Serve requests until the client leaves, a limit trips or a response says close. Checkpoints."""
        async with trio.open_nursery() as nursery:
            self.transport.nursery = nursery  # where a flusher runs when the client is behind
            try:
                while True:
                    request = await self._next_request()
                    if request is None:
                        return
                    until = await self._answer(request)
                    if until is None:
                        return
                    if until > trio.current_time():
                        await self._pause(until)
                        if self.gone:
                            return
            except PeerGone:
                return
            finally:
                nursery.cancel_scope.cancel()
                await self._close()

    # ------------------------------------------------------------- request heads

    async def _next_request(self) -> h11.Request | PlainRequest | None:
        """The next request head (a whole plain request: :mod:`._plain_http`), or None when the connection
        should end.

        Every head is accepted or refused by :func:`iop_http.accept_head` before any parser frames it:
        the module decides where the body ends, and h11 (which reads the head only once the module
        accepted it) frames the same bytes the same way. A refusal is answered and closes the connection.
        """
        self._chunks = None
        read = await self._read_head()
        if read is None or isinstance(read, PlainRequest):
            return read
        buffered, end, scheduled = read
        head = accept_head(buffered[:end], self.limits.max_head_bytes)
        if type(head) is Refusal:
            await self._refuse_bytes(head)
            return None
        assert type(head) is RequestHead
        if head.length == CHUNKED and not self._chunks_ok(buffered[end:]):
            await self._refuse_bytes(_MALFORMED_CHUNKS)
            return None
        try:
            event = self.h11.next_event()
        except h11.RemoteProtocolError:
            event = None
        if type(event) is not h11.Request:  # never, with the module's rules stricter than h11's
            logger.warning("h11 refuses a request head iop_http accepted: closing the connection")
            await self._refuse_bytes(_UNREADABLE)
            return None
        self._request_head = head
        if not scheduled:
            await trio.lowlevel.checkpoint()  # read without waiting: still one schedule point per request
        return event

    async def _read_head(self) -> PlainRequest | tuple[bytes, int, bool] | None:
        """Read until a whole head is buffered: (the buffered bytes, the head's length, whether a schedule
        point passed), or a whole plain request, or None when the connection ends (a refusal sent)."""
        head_deadline = math.inf
        scheduled = self._resumed  # a schedule point passed for this request (a pause's wake-up)
        self._resumed = False
        conn = self.h11
        max_head = self.limits.max_head_bytes
        # Nothing buffered (the usual case between keep-alive requests): the plain lane may take the read.
        fresh = conn.trailing_data == (b"", False)
        buffered = b"" if fresh else conn.trailing_data[0]
        while True:
            end = find_head_end(buffered)
            if end >= 0:
                break
            refusal = head_too_large(buffered, max_head)
            if refusal is not None:
                await self._refuse_bytes(refusal)
                return None
            if conn.trailing_data[1]:
                return None  # the client closed (mid-head or between requests)
            if buffered and head_deadline == math.inf:
                head_deadline = trio.current_time() + self.limits.header_timeout
            self._unparsed = None  # h11 now holds more than the bytes read on the pause's end
            # Bytes already there (a keep-alive client's next request usually is, by the time the
            # previous one is done) are read without a timer; the schedule point follows the head.
            data = self.transport.receive_nowait()
            if data is None:
                deadline = head_deadline
                if deadline == math.inf:
                    deadline = trio.current_time() + self.limits.keep_alive_timeout
                data = await self._receive(deadline, "request head")
                scheduled = True
            if fresh:
                fresh = False
                plain = self._plain_lane(data)
                if plain is not None:
                    if not scheduled:
                        await trio.lowlevel.checkpoint()  # one schedule point per request, as below
                    return plain
            if data and head_deadline == math.inf:
                head_deadline = trio.current_time() + self.limits.header_timeout
            conn.receive_data(data)
            buffered = conn.trailing_data[0]
        return buffered, end, scheduled

    def _plain_lane(self, data: bytes) -> PlainRequest | None:
        """``data``, a fresh read on an idle connection, as a whole plain request, or None to read it the
        usual way."""
        plain = parse_plain(data, self.limits.max_head_bytes)
        if plain is not None:
            self._request_head = plain.head
            self._plain_request = plain
        return plain

    def _chunks_ok(self, data: bytes) -> bool:
        """Start checking a chunked body's framing with the bytes after its head; False when malformed."""
        self._chunks = ChunkedBody()
        self._chunks_pending = b""
        return self._check_chunks(data)

    def _check_chunks(self, data: bytes) -> bool:
        """Check the next bytes of a chunked request body (:class:`iop_http.ChunkedBody`), as h11 reads
        them too: h11 takes chunk sizes iop_http refuses. False when the framing is malformed."""
        chunks = self._chunks
        if chunks is None or chunks.done:
            return True
        data = self._chunks_pending + data
        try:
            _, used = chunks.feed(data)
        except MalformedChunk:
            return False
        self._chunks_pending = b"" if chunks.done else data[used:]
        return True

    async def _refuse_bytes(self, refusal: Refusal) -> None:
        """Answer a request refused on its framing (fixed text) and end the connection."""
        self.gone = True
        if self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            await self.transport.send_all(error_response(refusal))

    async def _receive(self, deadline: float, what: str) -> bytes:
        with trio.move_on_at(deadline):
            return await self.transport.receive_some()
        if what == "request head" and self.h11.trailing_data[0]:
            logger.info("client sent no complete request head within %.3g s: disconnecting", self.limits.header_timeout)
        raise PeerGone

    # -------------------------------------------------------------- the exchange

    async def _pause(self, until: float) -> None:
        """Leave the connection unread until ``until`` (trio's clock; pacing); counted as paused meanwhile.

        On a plain TCP connection with ``refuse_head``, the pacer answers a
        refused retry itself (:meth:`_answer_paused`); when it found nothing to
        read and gave up, the task waits for the client's bytes here and
        answers them the same way, pausing again when they are refused again.
        """
        answer = self._answer_paused if self.refuse_head is not None and self._plain else None
        while True:
            self.counter.paused += 1
            try:
                await self.pacer.pause(until, answer)
            finally:
                self.counter.paused -= 1
            if not self._idle:
                break
            self._idle = False
            again = await self._answer_when_readable()
            if again is None:
                break
            until = again
        self._resumed = True  # the wake-up was this request's schedule point: its head is read at once

    async def _answer_when_readable(self) -> float | None:
        """Wait (up to ``keep_alive_timeout``) for the client's next bytes; :meth:`_answer_bytes` them."""
        assert isinstance(self.transport, SocketTransport)
        with trio.move_on_after(self.limits.keep_alive_timeout):
            while True:
                await trio.lowlevel.wait_readable(self.transport.sock)
                data = self.transport.receive_nowait()
                if data is not None:
                    return self._answer_bytes(data)
        raise PeerGone

    def _answer_paused(self, due: float) -> float | None:
        """The pacer's answer when this connection's pause is ``due`` (runs in the pacer's task, never waits).

        Reads what the client sent. When it is exactly a request the listener
        refused before (:meth:`Pacer.recall`) and ``refuse_head`` refuses it
        again, the refusal goes out here and the new pause time is returned:
        the connection's task sleeps on. When nothing came yet, the pacer looks
        again :data:`TOLD_GRACE` after the time its client was told to come
        back, if that is later (the pause ends at the refusal rate's return
        time, which may come before the ``Retry-After`` of a long queue), and
        after that :data:`RECHECK_AFTER` apart, up to :data:`RECHECKS` times (a
        client a little late, as on a busy host, costs a ``recv`` each time, not
        a wake-up of its own and a wait for the socket). Otherwise the bytes go
        to h11 and None wakes the task, which carries on as after any pause.
        """
        conn = self.h11
        if conn.their_state is not h11.IDLE or conn.trailing_data != (b"", False):
            return None
        try:
            data = self.transport.receive_nowait()
        except PeerGone:
            data = b""
        if data is None:
            now = trio.current_time()
            if self._told + TOLD_GRACE > now + PACING_QUANTUM:  # told to come back later: look then
                return step_after(due, self._told + TOLD_GRACE)
            if self._rechecks < RECHECKS:  # late: look again soon
                self._rechecks += 1
                return step_after(due, now + PACING_QUANTUM)
            self._rechecks = 0
            self._idle = True  # the task waits for the client (:meth:`_answer_when_readable`)
            return None
        self._rechecks = 0
        return self._answer_bytes(data)

    def _answer_bytes(self, data: bytes) -> float | None:
        """Answer ``data``, the client's bytes read on a fresh h11 connection: the time to pause until
        when it is a remembered request refused again (the refusal sent), else None (the bytes are
        h11's)."""
        conn = self.h11
        head = self.pacer.recall(data) if data else None
        refused = self._decide(*head) if head is not None else None
        if refused is None:
            conn.receive_data(data)
            self._unparsed = data
            self._let_through = head is not None
            return None
        response, until = refused
        self.transport.write_nowait(response.keep_alive)
        if self.transport.broken:
            self.gone = True
            return None
        self._booked(response)
        return until

    def _booked(self, response: CannedResponse) -> None:
        """Note when the client refused with ``response`` was told to come back (its ``Retry-After``)."""
        after = response.retry_after
        self._told = -math.inf if after is None else trio.current_time() + after

    def _decide(self, method: bytes, target: bytes, headers: Headers) -> tuple[CannedResponse, float] | None:
        """``refuse_head``'s answer for a request head; None (the app answers) if it raised."""
        assert self.refuse_head is not None
        try:
            return self.refuse_head(method, target, headers)
        except Exception:
            logger.exception("error while deciding on %s %r: the app answers it", method, target)
            return None

    async def _answer(self, request: h11.Request | PlainRequest) -> float | None:
        """Answer ``request``: refused on its head, or through the app.

        Returns:
            The time before which the next request is not read, or None when
            the connection cannot carry another request.
        """
        unparsed, self._unparsed = self._unparsed, None
        decided, self._let_through = self._let_through and unparsed is not None, False
        asked = self.refuse_head is not None and request.method != b"HEAD"
        if asked and not decided:
            refused = self._decide(request.method, self._path(request), request.headers)
            if refused is not None:
                return await self._refuse(*refused, request, unparsed)
        self.head_let_through = asked
        until = await self._respond(request)
        return until if await self._ready_for_next() else None

    async def _refuse(
        self, response: CannedResponse, until: float, request: h11.Request | PlainRequest, unparsed: bytes | None
    ) -> float | None:
        """Answer ``request`` with ``response`` before the app sees it; like :meth:`_answer`.

        A body already received whole is skipped and the pre-encoded bytes go out
        as they are; h11 then starts afresh on what follows (the next request,
        pipelined). A body still to come (or awaited behind ``100 Continue``)
        gets the response with ``connection: close`` and the connection ends: where
        that body ends is the client's word only. When the request was exactly the bytes
        ``unparsed`` (read whole on a pause's end, nothing after them), the pacer
        remembers its head by them. A plain request (h11 has not seen it) is
        whole and keeps the connection: the pre-encoded bytes go out.
        """
        if type(request) is PlainRequest:
            self._plain_request = None
            await self._send_bytes(response.keep_alive)
            if self.gone:
                return None
            self._booked(response)
            return until
        assert type(request) is h11.Request
        conn = self.h11
        try:
            event = conn.next_event()
            while isinstance(event, h11.Data):
                event = conn.next_event()
        except h11.RemoteProtocolError:
            return None  # a malformed body: nothing to answer it with
        if not isinstance(event, h11.EndOfMessage):  # the body is not read: the connection cannot go on
            await self._send_bytes(response.closing)
            return None
        keep_alive = conn.their_state is h11.DONE  # MUST_CLOSE: HTTP/1.0, or connection: close
        await self._send_bytes(response.keep_alive if keep_alive else response.closing)
        if not keep_alive or self.gone:
            return None
        rest, closed = conn.trailing_data
        if unparsed is not None and not rest and not closed:
            self.pacer.remember(unparsed, (request.method, self._path(request), request.headers))
        self._booked(response)
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_head_bytes)
        if rest:
            self.h11.receive_data(rest)
        if closed:
            self.h11.receive_data(b"")
        return until

    def _path(self, request: h11.Request | PlainRequest) -> bytes:
        """The origin-form target ``request`` is routed by (an absolute-form target's path and query)."""
        head = self._request_head
        return head.path if head is not None else request.target

    async def _respond(self, request: h11.Request | PlainRequest) -> float:
        """Call the app for ``request``; returns when the next request may be read (``PAUSE_READING``)."""
        self._head = None
        self._body_done = False
        self._plain_answered = False
        self._response_started = False
        self._chunked = False
        self._suppress_body = request.method == b"HEAD"
        self._continued = False
        self._status = 0
        target = self._path(request).decode("latin-1")
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
            "extensions": self._extensions,
        }
        try:
            await self.app(scope, self._receive_message, self._send_message)
        except Exception:
            logger.exception("error while answering %s %s", scope["method"], path)
            if not self._response_started and not self.gone:
                await self._send_message({"type": "http.response.start", "status": 500, "headers": []})
                await self._send_message({"type": "http.response.body", "body": b"internal error"})
        finally:
            if self._watcher is not None:
                self._watcher.stop()
        await self.transport.wait_written()  # a response written without waiting (respond_nowait)
        if self.h11.our_state is h11.SEND_BODY and not self.gone:
            raise PeerGone  # the app ended a response midway: the client cannot frame it
        until: float = scope.get(PAUSE_READING, -math.inf)
        return until

    async def _receive_message(self) -> Message:
        """ASGI ``receive``: the next body chunk, then (after the body) the client's departure."""
        if self.gone:
            return _DISCONNECT
        if self._body_done:
            return await self._wait_disconnect()
        plain = self._plain_request
        if plain is not None:
            self._body_done = True
            return {"type": "http.request", "body": plain.body, "more_body": False}
        if self.h11.they_are_waiting_for_100_continue:
            self._continued = True
            await self._send_bytes(self.h11.send(h11.InformationalResponse(status_code=100, headers=[])))
        try:
            return await self._next_body_message()
        except PeerGone:
            self.gone = True
            return _DISCONNECT
        except (MalformedChunk, h11.RemoteProtocolError):
            if not self._response_started:
                self._response_started = True
                await self._refuse_bytes(_MALFORMED_CHUNKS)
            self.gone = True
            return _DISCONNECT

    async def _next_body_message(self) -> Message:
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                data = await self._receive(trio.current_time() + self.limits.read_timeout, "body")
                if not self._check_chunks(data):
                    raise MalformedChunk("malformed chunked body")
                self.h11.receive_data(data)
                continue
            if isinstance(event, h11.Data):
                return self._body_message(bytearray(event.data))
            if isinstance(event, h11.EndOfMessage):
                self._body_done = True
                return {"type": "http.request", "body": b"", "more_body": False}
            raise PeerGone  # ConnectionClosed mid-body

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

    def cancel_on_disconnect(self, cancel_scope: trio.CancelScope) -> None:
        """Cancel ``cancel_scope`` if the client goes away before the app returns (never waits).

        The scope's ``cancel_on_disconnect`` (:class:`ConnectionHooks`) extension (plain TCP connections
        only). Call it once the request body is read, and do not ``receive``
        meanwhile: the connection's watcher reads the socket until the app
        returns, keeping what it reads for the next request.
        """
        if self.gone:
            cancel_scope.cancel()
            return
        if self._watcher is None:
            assert self.transport.nursery is not None and isinstance(self.transport, SocketTransport)
            if self.disconnects is not None:
                self._watcher = PolledWatch(self.disconnects, self, self.transport.sock)
            else:
                watcher = self._watcher = DisconnectWatcher(self, self.transport.sock)
                self.transport.nursery.start_soon(watcher.run)
        self._watcher.watch(cancel_scope)

    def keep_read(self, data: bytes) -> bool:
        """Keep bytes the disconnect watch read (a pipelined next request) for the next request; whether
        to go on watching (no: past ``max_head_bytes`` of them, the rest stays in the socket)."""
        self.h11.receive_data(data)
        return len(self.h11.trailing_data[0]) <= self.limits.max_head_bytes

    async def _wait_disconnect(self) -> Message:
        """Read (and keep, for the next request) until the client goes away."""
        while not self.gone:
            if len(self.h11.trailing_data[0]) > self.limits.max_head_bytes:
                await trio.sleep_forever()  # pipelined too far ahead: stop reading, keep the bytes
            try:
                data = await self.transport.receive_some()
            except PeerGone:
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
        more = message.get("more_body", False)
        data = self._encoded(message.get("body", b""), more)
        if not data:
            return
        if more:  # a body chunk: written at once, waiting only for a client far behind
            self.transport.write_nowait(data)
            await self.transport.wait_below_limit()
        else:
            await self._send_bytes(data)
        if self.transport.broken:
            self.gone = True

    def _encoded(self, body: bytes, more: bool) -> bytes:
        """The response's bytes for ``body``: after the head if it is not out yet, before the end unless ``more``.

        A plain request's whole plain answer is written in the plain lane; any other answer to it
        hands the request to h11 first (:meth:`_to_h11`), which writes it.
        """
        if self._plain_request is not None:
            if self._head is not None and not more:
                data = plain_response(*self._head, body)
                if data is not None:
                    self._head = None
                    self._plain_answered = True
                    return data
            if not self._to_h11():
                return b""
        parts: list[bytes] = []
        if self._head is not None:
            status, headers = self._head
            self._head = None
            self._status = status
            parts.append(self.h11.send(_response(status, headers)) or b"")
        if body and not self._suppress_body:
            parts.append(self._framed(body))
        if not more:
            self._chunked = False
            parts.append(self.h11.send(h11.EndOfMessage()) or b"")
        return b"".join(parts)

    def respond_nowait(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        """Write a whole response now, from any task (never waits).

        The ``respond_nowait`` extension of the scope: a relay whose whole
        answer arrives in another task (a node link's reader) writes it from
        there, without a task switch to the handler; the handler still returns
        as usual, and the connection reads its next request once every byte is
        written. The request's disconnect watch (``cancel_on_disconnect`` (:class:`ConnectionHooks`))
        ends here. ``headers`` must frame ``body`` (a ``content-length``).

        Returns:
            False when nothing was written: the response was started already
            (send the rest through ``send``), or the client is gone (as is the
            connection when the head does not frame the body).
        """
        if self._response_started or self.gone:
            return False
        self._head = (status, headers)
        try:
            data = self._encoded(body, more=False)
        except h11.LocalProtocolError:  # the head does not frame the body: nothing went out, nothing can
            self.gone = True
            return False
        self._response_started = True
        self.transport.write_nowait(data)
        if self.transport.broken:
            self.gone = True
        if self._watcher is not None:
            # The client has its answer: its leaving no longer cancels anything, and a next request
            # it sends before the app returns waits in the socket for this task (no poller wake-up).
            self._watcher.stop()
        return True

    def write_body_nowait(self, data: bytes) -> bool:
        """Write a chunk of the response body now, from any task (never waits).

        The ``write_body_nowait`` extension of the scope: for a relay that
        gets the bytes in another task (a node link's reader) and wants them on
        the socket without a task switch. Call it only between the response
        head and the last body message, with nothing else writing meanwhile.

        Returns:
            False when the client is too far behind (more than
            :data:`WRITE_BUFFER_LIMIT` bytes wait for it); the chunk is kept.
            Bytes for a client that is gone are dropped (True).
        """
        if self.gone:
            return True
        if self._chunked:  # the common case, a relayed token: no h11 event, no state check
            return not data or self.transport.write_nowait(encode_chunk(data))
        if self._suppress_body or self.h11.our_state is not h11.SEND_BODY:
            return True
        try:
            framed = self._framed(data)
        except h11.LocalProtocolError:  # more than a content-length said: the response cannot go on
            self.gone = True
            return False
        return self.transport.write_nowait(framed)

    def _framed(self, data: bytes) -> bytes:
        """``data`` framed as the response body's next bytes, the way h11 frames them.

        h11 decides the framing of each response (a content-length, the chunked
        transfer coding, or the connection's end). Once h11 framed a chunk of
        this response as a chunk (its size in hex, CRLF, the bytes, CRLF), the
        later chunks of the response are framed the same way here, without an
        h11 event each: h11's event and state machine cost more than the rest of
        a relayed token's way through the Edge in Python, and the chunked
        coding keeps no state between chunks. h11 still writes the head and the
        last chunk, and every body it does not frame as chunks.
        """
        if self._chunked:
            return encode_chunk(data)
        framed = self.h11.send(h11.Data(data=data)) or b""
        self._chunked = bool(data) and framed == encode_chunk(data)
        return framed

    async def _send_bytes(self, data: bytes) -> None:
        await self.transport.send_all(data)
        if self.transport.broken:
            self.gone = True

    def _to_h11(self) -> bool:
        """Hand the plain request to h11 (its bytes, then those the client sent after them), so h11
        answers it; False when h11 refuses them (the connection is then gone)."""
        plain = self._plain_request
        assert plain is not None
        self._plain_request = None
        rest, closed = self.h11.trailing_data  # bytes read after the request (h11 had only those)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_head_bytes)
        conn.receive_data(plain.raw)
        try:
            while type(conn.next_event()) is not h11.EndOfMessage:
                pass
        except h11.RemoteProtocolError as exc:
            logger.warning("h11 refuses a request llhttp read (%s): closing the connection", exc)
            self.gone = True
            return False
        if rest:
            conn.receive_data(rest)
        if closed:
            conn.receive_data(b"")
        self.h11 = conn
        return True

    # ------------------------------------------------------------------- reuse

    async def _ready_for_next(self) -> bool:
        """Whether the connection can carry another request; drains an unread small body."""
        if self._plain_request is not None:  # the request and its whole answer never went through h11
            self._plain_request = None
            return self._plain_answered and not self.gone
        if self.gone or self.h11.our_state is not h11.DONE:
            return False
        if self.h11.their_state is h11.SEND_BODY:
            head = self._request_head
            if head is not None and head.expect_continue and not self._continued and head.length:
                return False  # the client waits to send its body: what follows is not a next request
            try:
                if self._status >= 400:  # a refusal keeps the connection only when its body is in hand
                    self._body_message(bytearray())
                else:
                    drained = 0
                    while self.h11.their_state is h11.SEND_BODY and drained <= DRAIN_LIMIT:
                        message = await self._next_body_message()
                        drained += len(message["body"])
            except (PeerGone, MalformedChunk, h11.RemoteProtocolError):
                return False
        if self.h11.their_state is not h11.DONE:
            return False
        self.h11.start_next_cycle()
        return True

    async def _close(self) -> None:
        """Close the transport, even when cancelled; bounded (``HttpLimits.close_timeout``)."""
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

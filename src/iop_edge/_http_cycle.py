"""One request's cycle on the Edge's listener: its state, the ASGI ``receive`` and ``send``, and the
out-of-band writes and disconnect hook the app gets through :class:`ConnectionHooks` (in the manner
of uvicorn's ``RequestResponseCycle``).

The connection (:mod:`._http_server`) reads and frames the request head and makes one
:class:`RequestCycle` per request it lets through; the cycle calls the app, reads the request body
when the app asks, writes the response, and says whether the connection can carry another request.

What the listener guarantees:

- **Disconnect**: once the body is read, ``receive`` waits for the client to
  go away and then returns ``http.disconnect``. On a plain TCP connection the
  scope's ``cancel_on_disconnect(cancel_scope)`` (:class:`ConnectionHooks`) does the same watching
  without a task per request: the listener's one disconnect poller (an epoll
  set of its own, Linux; elsewhere one watcher task per connection, parked
  between requests) cancels ``cancel_scope`` if the client goes away before
  the app returns, or before the app's whole response went out through
  ``respond_nowait`` (bytes of a next request read meanwhile are kept
  for it).
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
"""

from __future__ import annotations

import logging
import math
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any, Final, Protocol, final

import h11
import trio

from iop_http import MalformedChunk, Refusal, RequestHead, encode_chunk

from ._http_disconnects import DisconnectPoller, DisconnectWatcher, PolledWatch
from ._http_transport import PeerGone, SocketTransport, Transport
from ._plain_http import PlainRequest, plain_response

if TYPE_CHECKING:
    from ._http_server import HttpLimits

logger = logging.getLogger("iop_edge.http")

MALFORMED_CHUNKS: Final = Refusal(400, "malformed chunked body")

Message = MutableMapping[str, Any]
App = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Any]
DRAIN_LIMIT = 64 * 1024
"""Unread request body bytes the listener reads and drops to keep a connection alive."""

DISCONNECT: Message = {"type": "http.disconnect"}

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


class CycleHost(Protocol):
    """What a request cycle uses of its connection (:class:`iop_edge._http_server` ``_Connection``)."""

    h11: h11.Connection
    gone: bool
    app: App
    limits: HttpLimits
    transport: Transport
    disconnects: DisconnectPoller | None
    watcher: DisconnectWatcher | PolledWatch | None

    async def receive(self, deadline: float, what: str) -> bytes:
        """The client's next bytes by ``deadline`` (raises :class:`PeerGone`)."""
        ...

    def check_chunks(self, data: bytes) -> bool:
        """Check the next bytes of a chunked request body; False when malformed."""
        ...

    async def refuse_bytes(self, refusal: Refusal) -> None:
        """Answer a request refused on its framing and end the connection."""
        ...

    def keep_read(self, data: bytes) -> bool:
        """Keep bytes read for the next request; whether to go on reading."""
        ...

    async def send_bytes(self, data: bytes) -> None:
        """Write ``data`` and wait until it is out (or the client is gone)."""
        ...

    def hand_to_h11(self, plain: PlainRequest) -> bool:
        """Hand a plain request to h11 so h11 answers it; False when h11 refuses it (the connection is gone)."""
        ...


@final
class RequestCycle:
    """One request through the app: its response state, ASGI ``receive``/``send`` and :class:`ConnectionHooks`."""

    def __init__(
        self,
        conn: CycleHost,
        request: h11.Request | PlainRequest,
        target: bytes,
        head: RequestHead | None,
        plain: PlainRequest | None,
        head_let_through: bool,
    ) -> None:
        self.conn = conn
        self.transport = conn.transport
        self.request = request
        self.target = target
        """The origin-form target the request is routed by (an absolute-form target's path and query)."""
        self._request_head = head
        self._plain_request = plain  # the request in the plain lane (h11 has not seen it)
        self._plain_answered = False  # its whole answer went out in the plain lane
        self._head: tuple[int, list[tuple[bytes, bytes]]] | None = None
        self._continued = False  # 100 Continue went out for the request
        self._status = 0  # the status of the response, once its head is encoded
        self._body_done = False
        self._suppress_body = request.method == b"HEAD"
        self._response_started = False
        self._chunked = False  # h11 frames this response's body as chunks: later ones are framed alike
        self.head_let_through = head_let_through
        """:class:`ConnectionHooks`: ``refuse_head`` let the request through."""
        self.can_watch_disconnect = isinstance(conn.transport, SocketTransport)
        """:class:`ConnectionHooks`: :meth:`cancel_on_disconnect` is available."""

    async def respond(self) -> float:
        """Call the app for ``request``; returns when the next request may be read (``PAUSE_READING``)."""
        scope = asgi_scope(self.request, self.target, self)
        try:
            await self.conn.app(scope, self.receive, self.send)
        except Exception:
            logger.exception("error while answering %s %s", scope["method"], scope["path"])
            if not self._response_started and not self.conn.gone:
                await self.send({"type": "http.response.start", "status": 500, "headers": []})
                await self.send({"type": "http.response.body", "body": b"internal error"})
        finally:
            if self.conn.watcher is not None:
                self.conn.watcher.stop()
        await self.transport.wait_written()  # a response written without waiting (respond_nowait)
        if self.conn.h11.our_state is h11.SEND_BODY and not self.conn.gone:
            raise PeerGone  # the app ended a response midway: the client cannot frame it
        until: float = scope.get(PAUSE_READING, -math.inf)
        return until

    async def receive(self) -> Message:
        """ASGI ``receive``: the next body chunk, then (after the body) the client's departure."""
        if self.conn.gone:
            return DISCONNECT
        if self._body_done:
            return await self._wait_disconnect()
        plain = self._plain_request
        if plain is not None:
            self._body_done = True
            return {"type": "http.request", "body": plain.body, "more_body": False}
        if self.conn.h11.they_are_waiting_for_100_continue:
            self._continued = True
            await self.conn.send_bytes(self.conn.h11.send(h11.InformationalResponse(status_code=100, headers=[])))
        try:
            return await self._next_body_message()
        except PeerGone:
            self.conn.gone = True
            return DISCONNECT
        except (MalformedChunk, h11.RemoteProtocolError):
            if not self._response_started:
                self._response_started = True
                await self.conn.refuse_bytes(MALFORMED_CHUNKS)
            self.conn.gone = True
            return DISCONNECT

    async def _next_body_message(self) -> Message:
        while True:
            event = self.conn.h11.next_event()
            if event is h11.NEED_DATA:
                data = await self.conn.receive(trio.current_time() + self.conn.limits.read_timeout, "body")
                if not self.conn.check_chunks(data):
                    raise MalformedChunk("malformed chunked body")
                self.conn.h11.receive_data(data)
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
            event = self.conn.h11.next_event()
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
        if self.conn.gone:
            cancel_scope.cancel()
            return
        if self.conn.watcher is None:
            assert self.conn.transport.nursery is not None and isinstance(self.transport, SocketTransport)
            if self.conn.disconnects is not None:
                self.conn.watcher = PolledWatch(self.conn.disconnects, self.conn, self.transport.sock)
            else:
                watcher = self.conn.watcher = DisconnectWatcher(self.conn, self.transport.sock)
                self.conn.transport.nursery.start_soon(watcher.run)
        self.conn.watcher.watch(cancel_scope)

    async def _wait_disconnect(self) -> Message:
        """Read (and keep, for the next request) until the client goes away."""
        while not self.conn.gone:
            if len(self.conn.h11.trailing_data[0]) > self.conn.limits.max_head_bytes:
                await trio.sleep_forever()  # pipelined too far ahead: stop reading, keep the bytes
            try:
                data = await self.transport.receive_some()
            except PeerGone:
                data = b""
            if not data:
                self.conn.gone = True
                break
            self.conn.h11.receive_data(data)
        return DISCONNECT

    async def send(self, message: Message) -> None:
        """ASGI ``send``: the head waits for the first body chunk so both go in one write."""
        if self.conn.gone:
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
            await self.conn.send_bytes(data)
        if self.transport.broken:
            self.conn.gone = True

    def _encoded(self, body: bytes, more: bool) -> bytes:
        """The response's bytes for ``body``: after the head if it is not out yet, before the end unless ``more``.

        A plain request's whole plain answer is written in the plain lane; any other answer to it
        hands the request to h11 first (the connection's ``hand_to_h11``), which writes it.
        """
        if self._plain_request is not None:
            if self._head is not None and not more:
                data = plain_response(*self._head, body)
                if data is not None:
                    self._head = None
                    self._plain_answered = True
                    return data
            plain, self._plain_request = self._plain_request, None
            if not self.conn.hand_to_h11(plain):
                return b""
        parts: list[bytes] = []
        if self._head is not None:
            status, headers = self._head
            self._head = None
            self._status = status
            parts.append(self.conn.h11.send(_response(status, headers)) or b"")
        if body and not self._suppress_body:
            parts.append(self._framed(body))
        if not more:
            self._chunked = False
            parts.append(self.conn.h11.send(h11.EndOfMessage()) or b"")
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
        if self._response_started or self.conn.gone:
            return False
        self._head = (status, headers)
        try:
            data = self._encoded(body, more=False)
        except h11.LocalProtocolError:  # the head does not frame the body: nothing went out, nothing can
            self.conn.gone = True
            return False
        self._response_started = True
        self.transport.write_nowait(data)
        if self.transport.broken:
            self.conn.gone = True
        if self.conn.watcher is not None:
            # The client has its answer: its leaving no longer cancels anything, and a next request
            # it sends before the app returns waits in the socket for this task (no poller wake-up).
            self.conn.watcher.stop()
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
        if self.conn.gone:
            return True
        if self._chunked:  # the common case, a relayed token: no h11 event, no state check
            return not data or self.transport.write_nowait(encode_chunk(data))
        if self._suppress_body or self.conn.h11.our_state is not h11.SEND_BODY:
            return True
        try:
            framed = self._framed(data)
        except h11.LocalProtocolError:  # more than a content-length said: the response cannot go on
            self.conn.gone = True
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
        framed = self.conn.h11.send(h11.Data(data=data)) or b""
        self._chunked = bool(data) and framed == encode_chunk(data)
        return framed

    async def ready_for_next(self) -> bool:
        """Whether the connection can carry another request; drains an unread small body."""
        if self._plain_request is not None:  # the request and its whole answer never went through h11
            self._plain_request = None
            return self._plain_answered and not self.conn.gone
        if self.conn.gone or self.conn.h11.our_state is not h11.DONE:
            return False
        if self.conn.h11.their_state is h11.SEND_BODY:
            head = self._request_head
            if head is not None and head.expect_continue and not self._continued and head.length:
                return False  # the client waits to send its body: what follows is not a next request
            try:
                if self._status >= 400:  # a refusal keeps the connection only when its body is in hand
                    self._body_message(bytearray())
                else:
                    drained = 0
                    while self.conn.h11.their_state is h11.SEND_BODY and drained <= DRAIN_LIMIT:
                        message = await self._next_body_message()
                        drained += len(message["body"])
            except (PeerGone, MalformedChunk, h11.RemoteProtocolError):
                return False
        if self.conn.h11.their_state is not h11.DONE:
            return False
        self.conn.h11.start_next_cycle()
        return True


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


def asgi_scope(request: h11.Request | PlainRequest, target: bytes, hooks: ConnectionHooks) -> dict[str, Any]:
    """The ASGI HTTP scope of ``request``, routed by ``target`` (origin-form), with ``hooks`` as its extension."""
    path, _, query = target.decode("latin-1").partition("?")
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": request.http_version.decode(),
        "method": request.method.decode("ascii"),
        "scheme": "http",
        "path": urllib.parse.unquote(path) if "%" in path else path,
        "raw_path": path.encode("latin-1"),
        "query_string": query.encode("latin-1"),
        "headers": request.headers,
        "extensions": {CONNECTION: hooks},
    }

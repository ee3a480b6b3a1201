"""One request's cycle on the Edge's listener: its state, the ASGI ``receive`` and ``send``, and the
out-of-band writes and disconnect hook the app gets through :class:`ConnectionHooks` (in the manner
of uvicorn's ``RequestResponseCycle``).

The connection (:mod:`.server`) reads the request head and makes one
:class:`RequestCycle` per request it lets through; the cycle calls the app, reads the request body
from the connection's :class:`iop_http.RequestReader` when the app asks (its
:class:`~iop_edge.listener.body.RequestBody`), writes the response with :mod:`iop_http`'s
encoders, and says whether the connection can carry another request.

**Response framing**: :class:`iop_http.ResponseFraming` (a ``content-length``, chunks, or the
connection's close; keep-alive or close), as h11 frames an answer.

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

import enum
import logging
import math
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any, Final, Protocol, final

import trio

from iop_edge.listener.asgi import asgi_scope
from iop_edge.listener.body import DISCONNECT, Malformed, Message, RequestBody
from iop_edge.listener.disconnects import DisconnectPoller, DisconnectWatcher, PolledWatch
from iop_http import (
    MALFORMED_CHUNKS,
    BodyOverrun,
    Refusal,
    RequestHead,
    RequestReader,
    ResponseFraming,
    encode_chunk,
)
from iop_io import PeerGone, SocketTransport, Transport

if TYPE_CHECKING:
    from iop_edge.listener.server import HttpLimits

logger = logging.getLogger("iop_edge.http")

App = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Any]
PAUSE_READING = "iop.pause_reading"
"""Scope key: a time on trio's clock before which the connection's next request is not read (pacing)."""


_NO_SCOPE: Final[dict[str, Any]] = {}  # read only


class HandedOver(enum.Enum):
    """The type of :data:`HANDED_OVER`."""

    HANDED_OVER = "handed over"


HANDED_OVER: Final = HandedOver.HANDED_OVER
"""A request's answer when its app call handed the connection's next requests to another task
(:meth:`RequestCycle.serve_next_meanwhile`) and ran its tail in this one."""


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

    def serve_next_meanwhile(self) -> bool:
        """The response is complete: the connection serves its next requests while the app call
        finishes (its tail); whether it does."""
        ...


class CycleHost(Protocol):
    """What a request cycle uses of its connection (:class:`iop_edge.listener.server` ``_Connection``)."""

    reader: RequestReader
    gone: bool
    lingers: bool
    app: App
    limits: HttpLimits
    transport: Transport
    disconnects: DisconnectPoller | None
    watcher: DisconnectWatcher | PolledWatch | None

    async def receive(self, deadline: float, what: str) -> bytes:
        """The client's next bytes by ``deadline`` (raises :class:`PeerGone`)."""
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

    def hand_over(self, until: float) -> bool:
        """Serve the next requests (from ``until`` on) in another task; False while another tail runs."""
        ...

    def tail_ended(self) -> None:
        """The tail of :meth:`hand_over` is over."""
        ...


@final
class RequestCycle:
    """One request through the app: its response state, ASGI ``receive``/``send`` and :class:`ConnectionHooks`."""

    _scope: dict[str, Any]  # the app's scope while it runs (it holds the cycle: the cycle drops it after)

    def __init__(self, conn: CycleHost, request: RequestHead, head_let_through: bool) -> None:
        self.conn = conn
        self.transport = conn.transport
        self.request = request
        self._head: tuple[int, list[tuple[bytes, bytes]]] | None = None
        self._framing = ResponseFraming(request)
        self._body = RequestBody(conn, request)
        self._response_started = False
        self.head_let_through = head_let_through
        """:class:`ConnectionHooks`: ``refuse_head`` let the request through."""
        self.can_watch_disconnect = isinstance(conn.transport, SocketTransport)
        """:class:`ConnectionHooks`: :meth:`cancel_on_disconnect` is available."""
        self.handed_over = False
        """The app call runs its tail while the connection serves its next requests elsewhere."""

    async def respond(self) -> float:
        """Call the app for ``request``; returns when the next request may be read (``PAUSE_READING``)."""
        scope = self._scope = asgi_scope(self.request, self)
        try:
            await self.conn.app(scope, self.receive, self.send)
        except Exception:
            logger.exception("error while answering %s %s", scope["method"], scope["path"])
            if not self._response_started and not self.conn.gone:
                await self.send({"type": "http.response.start", "status": 500, "headers": []})
                await self.send({"type": "http.response.body", "body": b"internal error"})
        finally:
            self._scope = _NO_SCOPE  # no reference cycle left for the collector: freed by reference counting
            if self.handed_over:
                self.conn.tail_ended()
            elif self.conn.watcher is not None:
                self.conn.watcher.stop()
        if self.handed_over:  # the connection is another task's now
            return -math.inf
        await self.transport.wait_written()  # a response written without waiting (respond_nowait)
        if self._response_started and not self._framing.complete and not self.conn.gone:
            raise PeerGone  # the app ended a response midway: the client cannot frame it
        until: float = scope.get(PAUSE_READING, -math.inf)
        return until

    # ------------------------------------------------------------ the request

    async def receive(self) -> Message:
        """ASGI ``receive``: the next body chunk, then (after the body) the client's departure; after
        :meth:`serve_next_meanwhile` nothing (the socket is the next request's) until cancelled."""
        if self.handed_over:
            await trio.sleep_forever()
        if self.conn.gone:
            return DISCONNECT
        body = self._body
        if body.done:
            return await body.after_end()
        await body.continue_if_asked()
        try:
            return await body.next_message()
        except PeerGone:
            self.conn.gone = True
            return DISCONNECT
        except Malformed:
            if not self._response_started:
                self._response_started = True
                await self.conn.refuse_bytes(MALFORMED_CHUNKS)
            self.conn.gone = True
            return DISCONNECT

    def cancel_on_disconnect(self, cancel_scope: trio.CancelScope) -> None:
        """Cancel ``cancel_scope`` if the client goes away before the app returns (never waits).

        The scope's ``cancel_on_disconnect`` (:class:`ConnectionHooks`) extension (plain TCP connections
        only). Call it once the request body is read, and do not ``receive``
        meanwhile: the connection's watcher reads the socket until the app
        returns, keeping what it reads for the next request. After :meth:`serve_next_meanwhile`
        nothing is watched: the client has its answer.
        """
        if self.handed_over:
            return
        if self.conn.gone:
            cancel_scope.cancel()
            return
        if self.conn.watcher is None:
            assert self.conn.transport.nursery is not None and isinstance(self.transport, SocketTransport)
            if self.conn.disconnects is not None:
                self.conn.watcher = PolledWatch(self.conn.disconnects, self.conn, self.transport.io)
            else:
                watcher = self.conn.watcher = DisconnectWatcher(self.conn, self.transport.io)
                self.conn.transport.nursery.start_soon(watcher.run)
        self.conn.watcher.watch(cancel_scope)

    # ------------------------------------------------------------------ the response

    async def send(self, message: Message) -> None:
        """ASGI ``send``: the head waits for the first body chunk so both go in one write (after
        :meth:`serve_next_meanwhile`, nothing is written)."""
        if self.conn.gone or self.handed_over:
            return
        if message["type"] == "http.response.start":
            self._response_started = True
            self._head = (message["status"], list(message.get("headers", ())))
            return
        more = message.get("more_body", False)
        try:
            data = self._encoded(message.get("body", b""), more)
        except BodyOverrun:
            self.conn.gone = True
            return
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
        """The response's bytes for ``body``: after the head if it is not out yet, the end unless ``more``.

        Raises:
            BodyOverrun: more body than the response's ``content-length`` said.
        """
        framing = self._framing
        if framing.done:
            return b""
        head = b""
        if self._head is not None:
            status, headers = self._head
            if not self._body.done and not self._body.keeps_unread(status):
                framing.keep_alive = False  # the head says ``connection: close``
                self.conn.lingers = True
            head = framing.head(status, headers)
            self._head = None
        data = framing.body(body) if body else b""
        if more:
            return head + data if head else data
        return head + data + framing.end()

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
        except (
            ValueError
        ):  # the head does not frame the body (BodyOverrun), or a bad field: nothing went out, nothing can
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
            Bytes for a client that is gone, or after :meth:`serve_next_meanwhile`, are dropped (True).
        """
        if self.conn.gone or self.handed_over:
            return True
        framing = self._framing
        if framing.chunked:  # the common case, a relayed token
            return not data or self.transport.write_nowait(encode_chunk(data))
        if self._head is not None or framing.done:
            return True
        try:
            framed = framing.body(data)
        except BodyOverrun:  # more than a content-length said: the response cannot go on
            self.conn.gone = True
            return False
        return not framed or self.transport.write_nowait(framed)

    def serve_next_meanwhile(self) -> bool:
        """Let the connection read and serve its next requests in another task while this app call
        finishes its tail (never waits), as hypercorn serves a keep-alive connection's next request
        while the previous app call is still running.

        The :class:`ConnectionHooks` extension, for an app whose answer is out but which still has
        work to do (the Edge's API answered at a request's deadline and waits for the node to let go
        of the run). From here on, the tail writes nothing to the connection, reads nothing from it
        (``receive`` waits until cancelled), and is not cancelled by the client's leaving nor by the
        next request's disconnect watch; it is cancelled when the connection ends (as the app was).
        The next requests are answered in order, after this one: its response is complete.

        Returns:
            False, nothing changed (the connection waits for the app call to return, as without
            it): the response is not complete, the request body was not read to its end, the app
            is reading it, the connection cannot carry another request, or another request's tail
            still runs on this connection (one at a time: a client cannot pile them up).
        """
        conn = self.conn
        framing = self._framing
        if self.handed_over or conn.gone or self._body.waiting or not self._body.done:
            return False
        if not framing.complete or not framing.keep_alive:
            return False
        if not conn.hand_over(self._scope.get(PAUSE_READING, -math.inf)):
            return False
        self.handed_over = True
        if conn.watcher is not None:
            conn.watcher.stop()  # the client has its answer: its leaving no longer cancels this app call
        return True

    async def ready_for_next(self) -> bool:
        """Whether the connection can carry another request; drains an unread small body."""
        if self.conn.gone or not self._framing.complete or not self._framing.keep_alive:
            return False
        return await self._body.drain()

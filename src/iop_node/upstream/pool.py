"""The Node's upstream connection pool: :class:`H11Transport`, a lean HTTP/1.1 transport for ``httpx``.

:class:`H11Transport` replaces httpcore under the Node's ``httpx.AsyncClient``
for plain ``http://`` upstreams (the backends are on loopback or the LAN).
Why: under load httpcore took much of the Node's CPU -- it scans every pooled
connection on each request (``is_idle``, ``has_expired``, a readability poll
per idle socket) and writes the request head and body as two socket sends.
Here one request costs one ``send`` (head and body together), one poll of
the ONE idle connection it takes, and the reads of the answer; HTTP itself is
the libraries': h11 (a sans-I/O state machine) writes the request, httptools
(llhttp, in C) parses the answer (:mod:`iop_http.answer` says why). As httpcore
cuts it: this module is the pool; :mod:`.http11` the exchange on one connection
and the answer's body; :mod:`.connection` the connection (its socket, an
:class:`iop_io.ByteStream`). Runs use
:meth:`H11Transport.post` (its head written by h11 once per endpoint:
:class:`PostRequests`) and read the body from the :class:`Answer` (no
``httpx`` request/response objects); ``httpx`` clients get the same through
:meth:`H11Transport.handle_async_request`.

Design notes:

- Pool. Idle connections are kept per origin on a LIFO stack; a request takes
  the most recently used one or opens a new one on demand. At most ``capacity``
  requests hold a connection at once (a ``trio.Semaphore``; waiting longer than
  the pool timeout is ``httpx.PoolTimeout``), and opening one when ``capacity``
  connections exist closes an idle one first, so never more than ``capacity``
  sockets are open. The Node's gate already keeps a provider's requests at or
  under its capacity, so in practice nobody waits.
- Reuse. A connection goes back to the pool only when its answer was read to
  its end and HTTP allows another request on it; anything else (``connection: close``, an error, a body
  not read to its end because the run was cancelled or stopped early) closes it.
  An idle connection that became readable (the server closed it, or sent
  something unasked) is closed instead of used. A reused connection that fails
  before the first byte of the answer (the server closed it while our request
  was on its way) is retried once on a fresh connection.
- Errors are httpx's, so ``iop_node.upstream.http_upstream`` maps them as before: connect
  failure ``ConnectError``, timeouts ``ConnectTimeout`` / ``WriteTimeout`` /
  ``ReadTimeout`` / ``PoolTimeout``, a broken socket ``WriteError`` / ``ReadError``,
  bad HTTP or a connection closed mid-answer ``RemoteProtocolError``.
- Cancellation. Closing a socket is synchronous in trio, so a request or a body
  cancelled half-way closes its connection without awaiting and returns its
  pool slot; nothing half-read is ever reused.
- Ownership. A request's pool slot and the connection it uses live in one
  :class:`~iop_node.upstream.http11.Checkout`, the only thing that returns the
  slot (:meth:`H11Transport.give_back`, once).
- Abort. A connection given back under way (its answer not read to its end) while its
  run is being cancelled is held with its slot until the backend lets go, at most
  ``abort_grace`` seconds (:mod:`iop_node.upstream.abort`); outside a run it is closed at once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import final

import httpx
import trio

from iop_node.config import UpstreamLimits
from iop_node.upstream.abort import LETTING_GO, Lingering
from iop_node.upstream.connection import Connection, Origin, open_connection
from iop_node.upstream.http11 import (
    Answer,
    Checkout,
    PostRequests,
    ResponseBody,
    StaleConnection,
    exchange,
    seconds,
    written,
)

logger = logging.getLogger("iop_node")


@final
class H11Transport(httpx.AsyncBaseTransport):
    """``httpx`` transport over h11, llhttp and trio sockets with a bounded keep-alive pool.

    Plain ``http://`` only (``https://`` URLs raise ``httpx.UnsupportedProtocol``).

    Args:
        capacity: the most requests (and connections) at once.
        limits: the bounds on what the upstream sends (:class:`iop_http.AnswerParser`).
        abort_grace: seconds an aborted request's connection is held for its backend to let go
            (:mod:`iop_node.upstream.abort`); 0: closed at once.
    """

    def __init__(self, capacity: int, limits: UpstreamLimits | None = None, abort_grace: float = 0.0) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.limits = UpstreamLimits() if limits is None else limits
        self._slots = trio.Semaphore(capacity)
        self._idle: dict[Origin, list[Connection]] = {}
        self._open: set[Connection] = set()
        self._closed = False
        self.abort_grace = abort_grace
        self.opened = 0
        """Connections opened so far (a reused connection is not counted again)."""
        self.let_go_late = 0
        """Aborted requests whose backend had not let go when ``abort_grace`` ran out."""

    def __repr__(self) -> str:
        idle = sum(len(stack) for stack in self._idle.values())
        return f"<H11Transport {len(self._open)}/{self.capacity} connections, {idle} idle>"

    @property
    def open_connections(self) -> int:
        """Connections open now, idle or in use."""
        return len(self._open)

    @property
    def waiting(self) -> int:
        """Requests waiting for a pool slot (all ``capacity`` in use)."""
        return self._slots.statistics().tasks_waiting

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` and return the response with its body still to read.

        Checkpoints. The response's stream holds a pool slot and the connection
        until it is read to the end or closed. Cancellation closes the
        connection in use and returns the slot.

        Raises:
            httpx.UnsupportedProtocol: not an ``http://`` URL.
            httpx.PoolTimeout, httpx.ConnectError, httpx.ConnectTimeout, httpx.WriteError,
            httpx.WriteTimeout, httpx.ReadError, httpx.ReadTimeout, httpx.RemoteProtocolError:
                see :meth:`request`.
        """
        try:
            body = request.content
        except httpx.RequestNotRead:
            body = await request.aread()
        timeouts = request.extensions.get("timeout", {})
        answer = await self.request(request.method.encode("ascii"), request.url, request.headers.raw, body, timeouts)
        return httpx.Response(
            status_code=answer.status,
            headers=answer.headers,
            stream=ResponseBody(answer),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": answer.reason},
        )

    async def request(
        self,
        method: bytes,
        url: httpx.URL,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        timeouts: Mapping[str, float | None],
    ) -> Answer:
        """Send one request (head and body in one write) and read the answer's head.

        The lean path: no ``httpx.Request`` / ``httpx.Response`` objects. ``headers``
        must carry ``host`` and the body's framing (``content-length``). ``timeouts``
        has httpx's keys (``connect``, ``read``, ``write``, ``pool``; a missing one or
        None: no limit). Checkpoints. The answer holds a pool slot and the connection
        until its body is read to the end or it is closed; cancellation closes the
        connection in use and returns the slot.

        Raises:
            httpx.UnsupportedProtocol: not an ``http://`` URL.
            httpx.PoolTimeout: no slot free within the pool timeout.
            httpx.ConnectError, httpx.ConnectTimeout: the connection could not be opened.
            httpx.WriteError, httpx.WriteTimeout, httpx.ReadError, httpx.ReadTimeout,
            httpx.RemoteProtocolError: the exchange failed.
        """
        return await self.send_written(url, written(method, url, headers, body), timeouts, head_only=method == b"HEAD")

    async def post(
        self, requests: PostRequests, body: bytes, timeouts: Mapping[str, float | None], *, whole: bool = False
    ) -> Answer:
        """``POST`` ``body`` to ``requests.url`` (a run's request). See :meth:`request`.

        ``whole``: the answer is relayed whole (a non-stream run): its body is bounded by
        ``limits.answer_bytes`` (past it, reading fails with ``AnswerTooLarge``).
        """
        return await self.send_written(requests.url, requests.written(body), timeouts, whole=whole)

    async def send_written(
        self,
        url: httpx.URL,
        request: bytes,
        timeouts: Mapping[str, float | None],
        *,
        head_only: bool = False,
        whole: bool = False,
    ) -> Answer:
        """Send ``request`` (the bytes h11 wrote for it: :func:`written`) to ``url``'s origin; read the answer's head.

        ``head_only``: the request is a ``HEAD`` (its answer has no body). ``whole``: see
        :meth:`post`. See :meth:`request`.
        """
        if url.raw_scheme != b"http":
            raise httpx.UnsupportedProtocol(f"H11Transport serves http:// only, not {url.scheme}://")
        if self._closed:
            raise RuntimeError("H11Transport is closed")
        origin = (url.raw_scheme, url.raw_host, url.port or 80)
        await self._acquire_slot(seconds(timeouts.get("pool")))
        checkout = Checkout(self)
        try:
            return await self._send(checkout, origin, request, (head_only, whole), timeouts)
        except BaseException:
            checkout.give_back(reusable=False)
            raise

    async def _send(
        self,
        checkout: Checkout,
        origin: Origin,
        request: bytes,
        shape: tuple[bool, bool],
        timeouts: Mapping[str, float | None],
    ) -> Answer:
        """Take a connection into ``checkout`` and exchange; a stale reused one is replaced once.

        ``shape``: ``(head_only, whole)`` (see :meth:`send_written`).
        """
        connect_timeout = seconds(timeouts.get("connect"))
        checkout.connection = await self._connection(origin, connect_timeout)
        try:
            return await exchange(checkout, request, shape, self.limits, timeouts)
        except StaleConnection:
            self._discard(checkout.connection)
            checkout.connection = None
        checkout.connection = await self._connection(origin, connect_timeout, fresh=True)
        return await exchange(checkout, request, shape, self.limits, timeouts)

    async def _acquire_slot(self, timeout: float) -> None:
        """Take a pool slot. Checkpoints only when it has to wait (the request checkpoints
        anyway when it reads); a cancelled wait takes no slot."""
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            with trio.move_on_after(timeout) as scope:
                await self._slots.acquire()
            if scope.cancelled_caught:
                raise httpx.PoolTimeout(f"all {self.capacity} upstream connections busy for {timeout:g} s") from None

    async def _connection(self, origin: Origin, timeout: float, *, fresh: bool = False) -> Connection:
        """Take a usable idle connection for ``origin`` (unless ``fresh``) or open a new one.

        Checkpoints if it opens one; cancellation then leaves nothing open.
        """
        stack = None if fresh else self._idle.get(origin)
        while stack:
            connection = stack.pop()
            if not connection.io.readable_now():
                return connection
            self._discard(connection)  # the server closed it (or sent something unasked)
        if len(self._open) >= self.capacity:
            self._close_one_idle()
        connection = await open_connection(origin, timeout)
        self._open.add(connection)
        self.opened += 1
        return connection

    def _close_one_idle(self) -> None:
        for stack in self._idle.values():
            if stack:
                self._discard(stack.pop(0))
                return

    def give_back(self, connection: Connection | None, *, reusable: bool) -> None:
        """Return a request's slot (:meth:`Checkout.give_back`); keep ``connection`` for reuse when
        ``reusable`` (its answer was read to its end), HTTP allows it and the pool is open, else close it."""
        if connection is not None:
            if reusable and not self._closed and connection.answer.reusable:
                self._idle.setdefault(connection.origin, []).append(connection)
            elif self._linger(connection):
                return  # the slot returns when the backend let go
            else:
                self._discard(connection)
        self._slots.release()

    def _linger(self, connection: Connection) -> bool:
        """Hold ``connection`` for its backend to let go, if it is an aborted request of a run:
        its answer not read to its end while the run's task is cancelled."""
        abandoned = LETTING_GO.get()
        if (
            abandoned is None
            or self.abort_grace <= 0
            or self._closed
            or connection.answer.complete
            or trio.current_effective_deadline() != -math.inf  # not cancelled: a failure, closed at once
        ):
            return False
        connection.io.end_sending()
        abandoned.hold(Lingering(connection, self.abort_grace, lambda let_go: self._let_go(connection, let_go)))
        return True

    def _let_go(self, connection: Connection, in_time: bool) -> None:
        """An aborted request's backend let go (``in_time``) or its grace ran out: close, return the slot."""
        if not in_time:
            self.let_go_late += 1
            logger.warning(
                "the backend at %s:%d did not let go of an aborted request within abort_grace_ms (%g s):"
                " its capacity returns now",
                connection.origin[1].decode("ascii", "replace"),
                connection.origin[2],
                self.abort_grace,
            )
        self._discard(connection)
        self._slots.release()

    def _discard(self, connection: Connection) -> None:
        connection.close()
        self._open.discard(connection)

    async def aclose(self) -> None:
        """Close every connection, idle or in use. Checkpoints."""
        self._closed = True
        for connection in list(self._open):
            self._discard(connection)
        self._idle.clear()
        await trio.lowlevel.checkpoint()

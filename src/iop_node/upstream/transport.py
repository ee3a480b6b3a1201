"""A lean HTTP/1.1 transport for ``httpx``: h11 and llhttp over non-blocking sockets, one keep-alive pool.

:class:`H11Transport` replaces httpcore under the Node's ``httpx.AsyncClient``
for plain ``http://`` upstreams (the backends are on loopback or the LAN).
Why (measured with benchmarks/e2e.py at concurrency 64, and written here only):
under load httpcore was a third of the Node's CPU -- it scans every pooled
connection on each request (``is_idle``, ``has_expired``, a readability poll
per idle socket) and writes the request head and body as two socket sends.
Here one request costs one ``send`` (head and body together), one poll of
the ONE idle connection it takes, and the reads of the answer; HTTP itself is
the libraries': h11 (a sans-I/O state machine) writes the request, httptools
(llhttp, in C) parses the answer (:mod:`iop_node.upstream.response` says why), and this
module only moves bytes. Runs use
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
  ``Checkout``, the only thing that returns the slot (once, whoever ends the
  exchange: a failure before the answer, the end of the body, an early close).
"""

from __future__ import annotations

import errno
import ipaddress
import math
import os
import select
import socket
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import final

import attrs
import h11
import httpx
import trio

from iop_http import length_framed
from iop_node.config import UpstreamLimits
from iop_node.upstream.response import ResponseParser

RECEIVE_SIZE = 64 * 1024

_Origin = tuple[bytes, bytes, int]


def _is_readable(sock: socket.socket) -> bool:
    """True when a read would not block: for an idle connection, EOF or unasked data."""
    fd = sock.fileno()
    if fd < 0:
        return True
    if sys.platform == "win32" or not hasattr(select, "poll"):
        return bool(select.select([fd], [], [], 0)[0])
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def _seconds(value: float | None) -> float:
    return math.inf if value is None else value


def _sent(sock: socket.socket, data: bytes | memoryview) -> int:
    """Bytes of ``data`` the kernel took now (0 when the send buffer is full)."""
    try:
        return sock.send(data)
    except BlockingIOError:
        return 0


async def _open_socket(host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket (``TCP_NODELAY`` set) to ``host``:``port``. Checkpoints.

    An IP address is connected with one non-blocking ``connect`` and a wait for
    writability (about a quarter of ``trio.open_tcp_stream``'s CPU, which resolves
    the name and races the addresses in a nursery); a host name, or Windows, goes
    through ``trio.open_tcp_stream``. Cancellation leaves nothing open.

    Raises:
        OSError: the connection failed.
    """
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = None
    if family is None or sys.platform == "win32":
        stream = await trio.open_tcp_stream(host, port)
        # trio connected it (address resolution, happy eyeballs, TCP_NODELAY); from here
        # on we drive the plain socket (see _Connection).
        sock = socket.socket(fileno=stream.socket.detach())
        sock.setblocking(False)
        return sock
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        error = sock.connect_ex((host, port))
        if error == errno.EINPROGRESS:
            await trio.lowlevel.wait_writable(sock)
            error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        else:
            await trio.lowlevel.checkpoint()
        if error:
            raise OSError(error, os.strerror(error))
    except BaseException:
        sock.close()
        raise
    return sock


def written(method: bytes, url: httpx.URL, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """The request as h11 writes it: its head, then ``body`` framed as ``headers`` say, then its end.

    Raises:
        h11.LocalProtocolError: the head is not valid HTTP/1.1 (a bad header, no body framing).
    """
    writer = h11.Connection(h11.CLIENT)  # h11 writes requests; answers are parsed by llhttp
    data = writer.send(h11.Request(method=method, target=url.raw_path, headers=headers))
    assert data is not None
    if body:
        data += writer.send(h11.Data(data=body)) or b""
    return data + (writer.send(h11.EndOfMessage()) or b"")


@final
class PostRequests:
    """The ``POST`` requests to one URL with one content type (a run endpoint's), as h11 writes them.

    h11 writes the first one. When the head it wrote ends with the
    ``content-length`` header and the body follows it as is (h11's framing of a
    body of known length), the later requests take that head with only the
    length changed, and no h11 connection, event and header validation each
    (about 20 µs, 7 % of the Node's CPU per run at concurrency 64; the Edge
    frames the chunks of a response after h11's first one the same way). Any
    other shape: h11 writes every request.
    """

    __slots__ = ("url", "_headers", "_head")

    def __init__(self, url: httpx.URL, content_type: bytes) -> None:
        self.url = url
        self._headers = [(b"host", url.netloc), (b"content-type", content_type)]
        self._head: bytes | None = None
        """h11's head up to the ``content-length`` header, once h11 wrote one of the expected shape."""

    def written(self, body: bytes) -> bytes:
        """The request that carries ``body``."""
        if self._head is not None:
            return self._head + length_framed(body)
        data = written(b"POST", self.url, [*self._headers, (b"content-length", b"%d" % len(body))], body)
        tail = length_framed(body)
        if data.endswith(tail):
            self._head = data[: -len(tail)]
        return data


@attrs.define(eq=False)
class _Connection:
    """One non-blocking stdlib socket and the parser of its current answer.

    The socket is read and written with plain non-blocking calls, waiting through
    trio's public low-level API (``wait_readable`` / ``wait_writable``) only when a
    call would block. A ``trio.SocketStream`` reschedules the task even when the
    syscall succeeds at once (a send: ~16 µs against ~1.7 µs for the bare call,
    measured on the benchmark box); here a read is one wait plus one ``recv``,
    and a write that fits in the send buffer does not reschedule at all.
    """

    origin: _Origin
    sock: socket.socket
    response: ResponseParser = attrs.field(factory=ResponseParser)
    """The answer of the current exchange (a fresh parser per request)."""
    requests: int = 0
    """Requests sent on this connection so far (more than 1: it was reused)."""

    def close(self) -> None:
        """Close the socket now, waking any task waiting on it. Synchronous: safe in a cancelled task."""
        if self.sock.fileno() >= 0:
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()

    async def send_all(self, data: bytes, timeout: float) -> None:
        """Write all of ``data``. Checkpoints only when the send buffer is full.

        Raises:
            trio.TooSlowError: the data did not go out within ``timeout`` seconds.
            OSError, trio.ClosedResourceError: the socket failed or was closed.
        """
        sent = _sent(self.sock, data)
        if sent == len(data):
            return
        rest = memoryview(data)[sent:]
        with trio.fail_after(timeout):
            while rest:
                await trio.lowlevel.wait_writable(self.sock)
                rest = rest[_sent(self.sock, rest) :]

    async def receive(self, timeout: float) -> bytes:
        """Read some bytes (``b""`` at EOF). Checkpoints (one wait for readability, then the ``recv``).

        Raises:
            httpx.ReadTimeout: nothing arrived for ``timeout`` seconds.
            httpx.ReadError: the socket failed.
        """
        # A bare cancel scope: trio.fail_after's context-manager machinery was ~10 % of the
        # Node's CPU with one read per token per stream (fleet benchmark, py-spy).
        with trio.CancelScope(deadline=trio.current_time() + timeout):
            return await self.receive_now()
        raise httpx.ReadTimeout(f"no data from the upstream for {timeout:g} s")

    async def receive_now(self) -> bytes:
        """Read some bytes (``b""`` at EOF), with no timeout of its own. Checkpoints.

        Raises:
            httpx.ReadError: the socket failed.
        """
        sock = self.sock
        try:
            while True:
                await trio.lowlevel.wait_readable(sock)
                try:
                    return sock.recv(RECEIVE_SIZE)
                except BlockingIOError:  # a spurious wakeup
                    pass
        except (OSError, trio.ClosedResourceError) as exc:
            raise httpx.ReadError(f"upstream read failed: {exc or type(exc).__name__}") from None

    def feed(self, data: bytes) -> None:
        """Parse bytes read from the socket (``b""``: the upstream closed it).

        Raises:
            httpx.RemoteProtocolError: the answer is not valid HTTP/1.1, or the
                connection closed in the middle of it.
        """
        if data:
            self.response.feed(data)
        else:
            self.response.feed_eof()


class _StaleConnection(Exception):
    """A reused connection failed before any byte of the answer: retry on a fresh one."""


@final
class H11Transport(httpx.AsyncBaseTransport):
    """``httpx`` transport over h11, llhttp and trio sockets with a bounded keep-alive pool.

    Plain ``http://`` only (``https://`` URLs raise ``httpx.UnsupportedProtocol``).

    Args:
        capacity: the most requests (and connections) at once.
        limits: the bounds on what the upstream sends (:class:`~iop_node.upstream.response.ResponseParser`).
    """

    def __init__(self, capacity: int, limits: UpstreamLimits | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.limits = UpstreamLimits() if limits is None else limits
        self._slots = trio.Semaphore(capacity)
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._closed = False
        self.opened = 0
        """Connections opened so far (a reused connection is not counted again)."""

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
            stream=_ResponseBody(answer),
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
        await self._acquire_slot(_seconds(timeouts.get("pool")))
        checkout = Checkout(self)
        try:
            return await self._send(checkout, origin, request, (head_only, whole), timeouts)
        except BaseException:
            checkout.give_back(reusable=False)
            raise

    async def _send(
        self,
        checkout: Checkout,
        origin: _Origin,
        request: bytes,
        shape: tuple[bool, bool],
        timeouts: Mapping[str, float | None],
    ) -> Answer:
        """Take a connection into ``checkout`` and exchange; a stale reused one is replaced once.

        ``shape``: ``(head_only, whole)`` (see :meth:`send_written`).
        """
        connect_timeout = _seconds(timeouts.get("connect"))
        checkout.connection = await self._connection(origin, connect_timeout)
        try:
            return await self._exchange(checkout, request, shape, timeouts)
        except _StaleConnection:
            self._discard(checkout.connection)
            checkout.connection = None
        checkout.connection = await self._connection(origin, connect_timeout, fresh=True)
        return await self._exchange(checkout, request, shape, timeouts)

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

    async def _connection(self, origin: _Origin, timeout: float, *, fresh: bool = False) -> _Connection:
        """Take a usable idle connection for ``origin`` (unless ``fresh``) or open a new one.

        Checkpoints if it opens one; cancellation then leaves nothing open.
        """
        stack = None if fresh else self._idle.get(origin)
        while stack:
            connection = stack.pop()
            if not _is_readable(connection.sock):
                return connection
            self._discard(connection)  # the server closed it (or sent something unasked)
        if len(self._open) >= self.capacity:
            self._close_one_idle()
        host = origin[1].decode("ascii")
        try:
            with trio.fail_after(timeout):
                sock = await _open_socket(host, origin[2])
        except trio.TooSlowError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{origin[2]} took over {timeout:g} s") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{origin[2]}: {exc}") from None
        connection = _Connection(origin, sock)
        self._open.add(connection)
        self.opened += 1
        return connection

    def _close_one_idle(self) -> None:
        for stack in self._idle.values():
            if stack:
                self._discard(stack.pop(0))
                return

    async def _exchange(
        self, checkout: Checkout, data: bytes, shape: tuple[bool, bool], timeouts: Mapping[str, float | None]
    ) -> Answer:
        """Send the request in one write, read the answer's head. Checkpoints.

        Raises:
            _StaleConnection: a reused connection failed before any answer byte.
        """
        connection = checkout.connection
        assert connection is not None
        reused = connection.requests > 0
        connection.requests += 1
        head_only, whole = shape
        response = connection.response = ResponseParser(head_only=head_only, limits=self.limits, whole=whole)
        timeout = _seconds(timeouts.get("write"))
        try:
            await connection.send_all(data, timeout)
        except trio.TooSlowError:
            raise httpx.WriteTimeout(f"sending to the upstream took over {timeout:g} s") from None
        except (OSError, trio.ClosedResourceError) as exc:
            if reused:
                raise _StaleConnection from None
            raise httpx.WriteError(f"upstream write failed: {exc or type(exc).__name__}") from None
        read_timeout = _seconds(timeouts.get("read"))
        if reused:
            # Nothing of the answer yet: EOF or a reset here means the server
            # closed the idle connection while our request was on its way.
            connection.feed(await self._receive_first(connection, read_timeout))
        while not response.head_done:  # (informational 1xx answers are skipped by the parser)
            connection.feed(await connection.receive(read_timeout))
        return Answer(checkout, read_timeout, response.status, response.reason, response.headers)

    @staticmethod
    async def _receive_first(connection: _Connection, timeout: float) -> bytes:
        try:
            data = await connection.receive(timeout)
        except httpx.ReadError:
            raise _StaleConnection from None
        if not data:
            raise _StaleConnection
        return data

    def _keep_or_discard(self, connection: _Connection) -> None:
        """An answer was read to its end: keep the connection if HTTP allows (and we are open)."""
        if not self._closed and connection.response.reusable:
            self._idle.setdefault(connection.origin, []).append(connection)
        else:
            self._discard(connection)

    def _discard(self, connection: _Connection) -> None:
        connection.close()
        self._open.discard(connection)

    async def aclose(self) -> None:
        """Close every connection, idle or in use. Checkpoints."""
        self._closed = True
        for connection in list(self._open):
            self._discard(connection)
        self._idle.clear()
        await trio.lowlevel.checkpoint()


@final
class Checkout:
    """One pool slot taken by one request, and the connection it uses.

    The only owner of the slot: :meth:`give_back` returns it exactly once, whoever
    calls it first (the request failing, the body ending, the body closed early).
    """

    __slots__ = ("_transport", "connection", "returned")

    def __init__(self, transport: H11Transport) -> None:
        self._transport = transport
        self.connection: _Connection | None = None
        self.returned = False

    def give_back(self, *, reusable: bool) -> None:
        """Return the slot; keep the connection (``reusable``: the answer was read to its end) or close it.

        Idempotent; synchronous (safe in a cancelled task).
        """
        if self.returned:
            return
        self.returned = True
        connection, self.connection = self.connection, None
        transport = self._transport
        if connection is not None:
            if reusable:
                transport._keep_or_discard(connection)
            else:
                transport._discard(connection)
        transport._slots.release()


@final
class Answer:
    """An upstream answer: its status line and headers, and its body read straight from the parser.

    Holds the request's pool slot and connection until the body is read to its end
    (the connection is kept for reuse if HTTP allows) or :meth:`close` is called
    (the connection is closed).

    Attributes:
        status: the status code.
        reason: the reason phrase, as sent.
        headers: the headers, as sent.
    """

    __slots__ = ("_checkout", "_timeout", "status", "reason", "headers")

    def __init__(
        self, checkout: Checkout, timeout: float, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]
    ) -> None:
        self._checkout = checkout
        self._timeout = timeout
        self.status = status
        self.reason = reason
        self.headers = headers

    @property
    def checkout(self) -> Checkout:
        """The pool slot and connection this answer holds (for :class:`iop_node.upstream.poller.BodyPoller`)."""
        return self._checkout

    @property
    def read_timeout(self) -> float:
        """Seconds of upstream silence that fail the body's reading."""
        return self._timeout

    async def next_chunk(self) -> bytes | None:
        """Every body byte available now (reading once if none is), or None after the end.

        Takes every body byte parsed from the bytes read so far, so a read that
        carries several chunks (or a whole body) is one chunk here. Checkpoints when
        it reads; cancellation closes the connection.

        Raises:
            httpx.ReadTimeout, httpx.ReadError, httpx.RemoteProtocolError: reading failed.
        """
        checkout = self._checkout
        try:
            while (connection := checkout.connection) is not None:
                chunk = take_body(checkout, connection)
                if chunk is not None or checkout.connection is None:
                    return chunk
                connection.feed(await connection.receive(self._timeout))
        except BaseException:
            checkout.give_back(reusable=False)
            raise
        return None

    async def pump(self, send: Callable[[bytes], Awaitable[None]]) -> None:
        """Hand the body to ``send`` until its end: every body byte available after each read.

        The push counterpart of :meth:`next_chunk`, for a run's relay: the read
        timeout is one cancel scope for many reads, moved only when it fires, where
        :meth:`next_chunk` enters one per read (enter and exit cost about two
        reschedules, paid once per token of a stream). Time spent in ``send`` (waiting
        for room to queue) does not count as upstream silence. Checkpoints when it
        reads; cancellation closes the connection, and a chunk is handed to ``send``
        whole or not at all.

        Raises:
            httpx.ReadTimeout, httpx.ReadError, httpx.RemoteProtocolError: reading failed.
        """
        checkout = self._checkout
        pump = _Pump(self._timeout)
        try:
            while True:
                with trio.CancelScope(deadline=pump.deadline()) as scope:
                    await pump.run(checkout, send)
                if not scope.cancelled_caught:
                    return
                if pump.timed_out():
                    raise httpx.ReadTimeout(f"no data from the upstream for {self._timeout:g} s")
        except BaseException:
            checkout.give_back(reusable=False)
            raise

    def close(self) -> None:
        """Stop reading; if the body was not read to its end, close the connection. Synchronous."""
        self._checkout.give_back(reusable=False)


@final
class _Pump:
    """The state of :meth:`Answer.pump` across its cancel scopes."""

    __slots__ = ("_timeout", "_waiting_since", "_pending")

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._waiting_since: float | None = None
        """When the current wait for the upstream began (None: not waiting for it)."""
        self._pending: bytes | None = None
        """A chunk taken from the parser and not yet accepted by ``send``."""

    def deadline(self) -> float:
        since = self._waiting_since
        return (trio.current_time() if since is None else since) + self._timeout

    def timed_out(self) -> bool:
        """The scope's deadline fired: True if the upstream really was silent for the timeout."""
        since = self._waiting_since
        return since is not None and trio.current_time() - since >= self._timeout

    async def run(self, checkout: Checkout, send: Callable[[bytes], Awaitable[None]]) -> None:
        """Read and send until the body ends. Checkpoints; stops early only by cancellation."""
        while True:
            if self._pending is None and (connection := checkout.connection) is not None:
                self._pending = take_body(checkout, connection)
            if self._pending is not None:
                await send(self._pending)
                self._pending = None
                continue
            connection = checkout.connection
            if connection is None:
                return
            if self._waiting_since is None:  # not when a wait resumes after a scope moved on
                self._waiting_since = trio.current_time()
            data = await connection.receive_now()
            self._waiting_since = None
            connection.feed(data)


def take_body(checkout: Checkout, connection: _Connection) -> bytes | None:
    """Every body byte parsed so far and not yet taken, giving the checkout back at the end of the body."""
    response = connection.response
    chunk = response.take()
    if response.complete:
        checkout.give_back(reusable=True)
    return chunk


@final
class _ResponseBody(httpx.AsyncByteStream):
    """An :class:`Answer`'s body as an ``httpx`` response stream.

    A plain async iterator (no async generator: nothing is left half-run when
    the reader stops early).
    """

    def __init__(self, answer: Answer) -> None:
        self._answer = answer

    def __aiter__(self) -> _ResponseBody:
        return self

    async def __anext__(self) -> bytes:
        """The next body chunk. Checkpoints when it reads; cancellation closes the connection.

        Raises:
            StopAsyncIteration: the body ended (or the stream was closed).
            httpx.ReadTimeout, httpx.ReadError, httpx.RemoteProtocolError: reading failed.
        """
        chunk = await self._answer.next_chunk()
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        """Close the body; if it was not read to its end, close the connection. Does not checkpoint."""
        self._answer.close()

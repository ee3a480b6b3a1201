"""HTTP/1.1 over one upstream connection: the request written by h11, the answer read by llhttp.

The layer between the pool (:mod:`iop_node.upstream.pool`) and the connection
(:mod:`iop_node.upstream.connection`), as httpcore's ``http11`` sits between its
pool and its connection. h11 (a sans-I/O state machine) writes the request
(:func:`written`, :class:`PostRequests`); :class:`iop_http.AnswerParser` (llhttp,
in C) parses the answer; :func:`exchange` sends the request in one write and
reads the answer's head; :class:`Answer` reads its body (pulled with
:meth:`Answer.next_chunk`, pushed with :meth:`Answer.pump`, or read by the
session's :class:`~iop_node.upstream.poller.BodyPoller`).

Ownership. A request's pool slot and the connection it uses live in one
:class:`Checkout`, the only thing that returns the slot (once, whoever ends the
exchange: a failure before the answer, the end of the body, an early close).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol, final

import h11
import httpx
import trio

from iop_http import AnswerParser, length_framed
from iop_io import PeerGone
from iop_node.config import UpstreamLimits
from iop_node.upstream.connection import Connection, feed


def seconds(value: float | None) -> float:
    """A timeout of httpx's (None: no limit) in seconds."""
    return math.inf if value is None else value


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
    (a visible share of the Node's CPU per run; the Edge frames the chunks of
    a response after h11's first one the same way). Any
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


class Pool(Protocol):
    """What a :class:`Checkout` needs of its pool."""

    def give_back(self, connection: Connection | None, *, reusable: bool) -> None:
        """Return a slot, and keep ``connection`` for reuse (``reusable`` and HTTP allows it) or close it."""
        ...


@final
class Checkout:
    """One pool slot taken by one request, and the connection it uses.

    The only owner of the slot: :meth:`give_back` returns it exactly once, whoever
    calls it first (the request failing, the body ending, the body closed early).
    """

    __slots__ = ("_pool", "connection", "returned")

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self.connection: Connection | None = None
        self.returned = False

    def give_back(self, *, reusable: bool) -> None:
        """Return the slot; keep the connection (``reusable``: the answer was read to its end) or close it.

        Idempotent; synchronous (safe in a cancelled task).
        """
        if self.returned:
            return
        self.returned = True
        connection, self.connection = self.connection, None
        self._pool.give_back(connection, reusable=reusable)


class StaleConnection(Exception):
    """A reused connection failed before any byte of the answer: retry on a fresh one."""


async def exchange(
    checkout: Checkout,
    data: bytes,
    shape: tuple[bool, bool],
    limits: UpstreamLimits,
    timeouts: Mapping[str, float | None],
) -> Answer:
    """Send the request ``data`` in one write on ``checkout``'s connection, read the answer's head. Checkpoints.

    ``shape``: ``(head_only, whole)`` (the request is a ``HEAD``; the answer is relayed
    whole, its body bounded by ``limits.answer_bytes``).

    Raises:
        StaleConnection: a reused connection failed before any answer byte.
        httpx.WriteError, httpx.WriteTimeout, httpx.ReadError, httpx.ReadTimeout,
        httpx.RemoteProtocolError: the exchange failed.
    """
    connection = checkout.connection
    assert connection is not None
    reused = connection.requests > 0
    connection.requests += 1
    head_only, whole = shape
    answer = connection.answer = AnswerParser(head_only=head_only, limits=limits, whole=whole)
    timeout = seconds(timeouts.get("write"))
    try:
        await connection.send_all(data, timeout)
    except trio.TooSlowError:
        raise httpx.WriteTimeout(f"sending to the upstream took over {timeout:g} s") from None
    except PeerGone as exc:
        if reused:
            raise StaleConnection from None
        raise httpx.WriteError(f"upstream write failed: {exc or 'the connection broke'}") from None
    read_timeout = seconds(timeouts.get("read"))
    if reused:
        # Nothing of the answer yet: EOF or a reset here means the server
        # closed the idle connection while our request was on its way.
        feed(connection.answer, await _receive_first(connection, read_timeout))
    while not answer.head_done:  # (informational 1xx answers are skipped by the parser)
        feed(connection.answer, await connection.receive(read_timeout))
    return Answer(checkout, read_timeout, answer.status, answer.reason, answer.headers)


async def _receive_first(connection: Connection, timeout: float) -> bytes:
    try:
        data = await connection.receive(timeout)
    except httpx.ReadError:
        raise StaleConnection from None
    if not data:
        raise StaleConnection
    return data


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
                feed(connection.answer, await connection.receive(self._timeout))
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
            feed(connection.answer, data)


def take_body(checkout: Checkout, connection: Connection) -> bytes | None:
    """Every body byte parsed so far and not yet taken, giving the checkout back at the end of the body."""
    answer = connection.answer
    chunk = answer.take()
    if answer.complete:
        checkout.give_back(reusable=True)
    return chunk


@final
class ResponseBody(httpx.AsyncByteStream):
    """An :class:`Answer`'s body as an ``httpx`` response stream.

    A plain async iterator (no async generator: nothing is left half-run when
    the reader stops early).
    """

    def __init__(self, answer: Answer) -> None:
        self._answer = answer

    def __aiter__(self) -> ResponseBody:
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

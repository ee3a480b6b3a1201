"""The head refusal and pacing room of one connection of the Edge's listener.

Asks ``refuse_head`` on a request head, answers a refused request with its :class:`CannedResponse`
(keeping the connection when the body is in hand), and keeps the connection unread while paused --
answering a flood's repeated retries from the pacer's task without waking the connection's
(:class:`Pacer`). The connection (:mod:`._http_server`) owns the socket and its parser; the desk
reads them only while the connection's task sleeps in :meth:`HeadDesk.pause`.

What the listener guarantees:

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
  is, byte for byte, a whole request the listener read and refused before
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
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, final

import trio

from iop_edge.listener.body import skip_buffered
from iop_edge.listener.pacing import PACING_QUANTUM, RECHECKS, TOLD_GRACE, Headers, Pacer, step_after
from iop_http import RequestHead, RequestReader
from iop_io import PeerGone, SocketTransport, Transport

if TYPE_CHECKING:
    from iop_edge.listener.server import CannedResponse, ConnectionCounter, HttpLimits

logger = logging.getLogger("iop_edge.http")

HeadRefuser = Callable[[bytes, bytes, Headers], "tuple[CannedResponse, float] | None"]
"""``refuse_head(method, target, headers)``: ``(response, pause until)`` to refuse a request on its head, or None."""


class DeskHost(Protocol):
    """What the desk uses of its connection (``_http_server``'s connection)."""

    reader: RequestReader
    gone: bool
    lingers: bool
    limits: HttpLimits
    transport: Transport

    async def send_bytes(self, data: bytes) -> None:
        """Write ``data`` and wait until it is out (or the client is gone)."""
        ...


@final
class HeadDesk:
    """One connection's head refusals and pauses."""

    def __init__(
        self, conn: DeskHost, counter: ConnectionCounter, pacer: Pacer, refuse_head: HeadRefuser | None
    ) -> None:
        self.conn = conn
        self.counter = counter
        self.pacer = pacer
        self.refuse_head = refuse_head
        self.unparsed: bytes | None = None  # all the bytes the reader holds, read whole on a pause's end
        self.let_through = False  # refuse_head let those bytes' request through already
        self._rechecks = 0  # times the pacer found nothing to read since the pause's end
        self._idle = False  # the pacer gave up looking: the task waits for the client's bytes
        self._plain = isinstance(conn.transport, SocketTransport)  # a pause's end may be answered without the task
        self._told = -math.inf  # when the last refused client was told to come back (Retry-After)

    async def pause(self, until: float) -> None:
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

    async def _answer_when_readable(self) -> float | None:
        """Wait (up to ``keep_alive_timeout``) for the client's next bytes; :meth:`_answer_bytes` them."""
        assert isinstance(self.conn.transport, SocketTransport)
        with trio.move_on_after(self.conn.limits.keep_alive_timeout):
            while True:
                await self.conn.transport.io.wait_readable()
                data = self.conn.transport.receive_nowait()
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
        to the reader and None wakes the task, which carries on as after any pause.
        """
        if not self.conn.reader.at_rest:
            return None
        try:
            data = self.conn.transport.receive_nowait()
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
        """Answer ``data``, the client's bytes read between requests with nothing buffered: the time to
        pause until when it is a remembered request refused again (the refusal sent), else None (the
        bytes go to the reader)."""
        head = self.pacer.recall(data) if data else None
        refused = self.decide(*head) if head is not None else None
        if refused is None:
            self.conn.reader.feed(data)
            self.unparsed = data
            self.let_through = head is not None
            return None
        response, until = refused
        self.conn.transport.write_nowait(response.keep_alive)
        if self.conn.transport.broken:
            self.conn.gone = True
            return None
        self._booked(response)
        return until

    def _booked(self, response: CannedResponse) -> None:
        """Note when the client refused with ``response`` was told to come back (its ``Retry-After``)."""
        after = response.retry_after
        self._told = -math.inf if after is None else trio.current_time() + after

    def decide(self, method: bytes, target: bytes, headers: Headers) -> tuple[CannedResponse, float] | None:
        """``refuse_head``'s answer for a request head; None (the app answers) if it raised."""
        assert self.refuse_head is not None
        try:
            return self.refuse_head(method, target, headers)
        except Exception:
            logger.exception("error while deciding on %s %r: the app answers it", method, target)
            return None

    async def refuse(
        self, response: CannedResponse, until: float, request: RequestHead, unparsed: bytes | None
    ) -> float | None:
        """Answer ``request`` with ``response`` before the app sees it; like the connection's answer.

        A body already received whole is skipped and the pre-encoded bytes go out
        as they are; the reader then goes on with what follows (the next request,
        pipelined). A body still to come (or awaited behind ``100 Continue``)
        gets the response with ``connection: close`` and the connection ends: where
        that body ends is the client's word only. When the request was exactly the bytes
        ``unparsed`` (read whole on a pause's end, nothing after them), the pacer
        remembers its head by them.
        """
        reader = self.conn.reader
        if not skip_buffered(reader):  # the body is not read (or malformed): the connection cannot go on
            self.conn.lingers = True
            await self.conn.send_bytes(response.closing)
            return None
        keep_alive = request.keep_alive  # not: HTTP/1.0, or connection: close
        await self.conn.send_bytes(response.keep_alive if keep_alive else response.closing)
        if not keep_alive or self.conn.gone:
            return None
        if unparsed is not None and reader.at_rest:
            self.pacer.remember(unparsed, (request.method, request.path, request.headers))
        self._booked(response)
        return until

"""Every plain-HTTP readiness probe of a node from one task: :class:`ProbeLoop`.

Why one task: a probe is a short ``GET`` answered in well under a millisecond, so
what it costs is the machinery around it. A task per provider that sleeps,
wakes, takes a pooled connection, waits for its socket and sleeps again costs
several times the probe itself, a thousand times a second at a thousand providers
probed every second. Here the probes' sockets stay registered in one
:class:`iop_io.ReadySet` (edge-triggered: a socket is reported once per arrival,
not again at the next round once read, so each read is until a read comes
short); the task wakes once per :data:`TICK`, reads every socket that has
data, feeds it to the connection's parser (:class:`iop_http.StatusAnswers`,
llhttp), and sends every probe that is due with one non-blocking ``send`` of the
request bytes h11 wrote once per path. A probe therefore waits up to a tick to
be sent and its answer up to a tick to be read: its timing is good to a tick.

Each provider has one keep-alive connection for its probes, never one of its
run pool's. A connection is opened with a non-blocking ``connect`` (an IP
address; a host name is resolved in a worker thread first), dropped when its
probe fails or times out, and opened again by the next probe. A kept connection
that the server closed while idle is noticed by its EOF and closed; a probe that
finds its connection closed before any byte of the answer tries once more on a
new one. Linux only (:data:`iop_io.CAN_POLL`); elsewhere the watcher probes with one
:class:`~iop_node.health.probe.ProbeClient` task per provider.
"""

from __future__ import annotations

import errno
import heapq
import ipaddress
import math
import os
import socket
from collections.abc import Callable
from typing import Final, final

import httpx
import trio

from iop_http import AnswerError, StatusAnswers
from iop_io import ReadySet
from iop_node.health.readiness import PASSED, ProbeResult, judge
from iop_node.upstream.http11 import written

TICK: Final = 0.1
"""Seconds between two rounds of the loop while probes are due or in flight.

A round costs a wakeup of the loop and its timer whatever it carries, so the
more probes a round carries the less each costs (docs/benchmarks.md, Figures
behind the code); its length is also how late a probe may be sent, timed out or
read. A probe's interval runs from its answer, as Envoy's, less the two
rounds at most that the loop added (its send waited for a round, its answer's
read for the next): a prompt answer's next probe is due an interval after this
one was due, so the rounds add no drift to the probe rate.

Rounds fall on a grid, the multiples of :data:`TICK` on trio's clock (:func:`grid_time`):
a probe waits in the bucket of the first grid time at or after it is due, and a
round takes the buckets whose time has come (an append and a pop of a list, not a
heap's walk of a thousand entries), so no probe goes before its time; other
periodic work of the node's health (the stall watchdog) ticks on the same grid,
so one wakeup of the process serves both."""

RECEIVE_SIZE: Final = 64 * 1024
ANSWER_BYTES: Final = 1024 * 1024
"""The most bytes of a probe answer's body read (vLLM's ``/metrics`` is the largest)."""

Done = Callable[[ProbeResult, float], float]
"""Called with a probe's result and the time of the loop's round; returns the seconds until that provider's next probe."""


_SLACK: Final = 1e-9
"""Of a round: a time a float's rounding put just off a grid time is on it."""


def round_of(at: float) -> int:
    """The round ``at`` falls in: the index of the last grid time (a multiple of :data:`TICK`) at or before it."""
    return math.floor(at / TICK + _SLACK)


def grid_time(at: float) -> float:
    """The first grid time (a multiple of :data:`TICK` on trio's clock) at or after ``at``."""
    return math.ceil(at / TICK - _SLACK) * TICK


@final
class Target:
    """One provider's probe: where it goes, its connection, and the exchange in progress."""

    __slots__ = (
        "kind",
        "host",
        "port",
        "requests",
        "limit",
        "done",
        "sock",
        "connecting",
        "reused",
        "parser",
        "waiting",
        "answers",
        "due",
        "scheduled",
        "deadline",
    )

    def __init__(self, kind: str, urls: tuple[httpx.URL, ...], limit: float) -> None:
        self.kind = kind
        self.host = urls[0].host
        self.port = urls[0].port or 80
        self.requests = tuple(written(b"GET", url, [(b"host", url.netloc)], b"") for url in urls)
        self.limit = limit
        self.done: Done = _unset
        """Set by the watcher before the target is scheduled."""
        self.sock: socket.socket | None = None
        self.connecting = False
        self.reused = False
        self.parser: StatusAnswers | None = None
        """The connection's parser, from its opening to its close."""
        self.waiting = False
        """A request was sent and its answer is not complete."""
        self.answers: list[tuple[int, bytes]] = []
        self.due = 0.0
        """When the probe in flight (or the last one) was due: the next is due an interval later."""
        self.scheduled = 0.0
        """When the next probe is due (while it waits in the loop's buckets)."""
        self.deadline = math.inf

    def __repr__(self) -> str:
        return f"<Target {self.kind} {self.host}:{self.port}{' probing' if self.waiting else ''}>"


@final
class ProbeLoop:
    """Sends and reads the probes of many :class:`Target` (see the module docstring)."""

    __slots__ = ("_ready", "_buckets", "_rounds", "_in_flight", "_wake", "_now", "probes")

    def __init__(self) -> None:
        self._ready: ReadySet[Target] = ReadySet(edge=True)
        self._buckets: dict[int, list[Target]] = {}
        """The probes waiting, by the round (the grid time over :data:`TICK`) that sends them."""
        self._rounds: list[int] = []
        """The rounds that have a bucket, a heap (a few dozen: the intervals over :data:`TICK`)."""
        self._in_flight: set[Target] = set()
        self._wake = trio.Event()
        self._now = 0.0
        """The time of the round under way (the loop's times are good to a round)."""
        self.probes = 0
        """Probes answered or failed so far."""

    def __repr__(self) -> str:
        scheduled = sum(map(len, self._buckets.values()))
        return f"<ProbeLoop {scheduled} scheduled, {len(self._in_flight)} in flight>"

    def schedule(self, target: Target, delay: float) -> None:
        """Probe ``target`` in ``delay`` seconds (then as its ``done`` says)."""
        self._push(target, trio.current_time() + delay)
        self._wake.set()

    def _push(self, target: Target, when: float) -> None:
        """Send ``target``'s next probe in the first round at or after ``when``."""
        target.scheduled = when
        key = math.ceil(when / TICK - _SLACK)
        bucket = self._buckets.get(key)
        if bucket is None:
            self._buckets[key] = [target]
            heapq.heappush(self._rounds, key)
        else:
            bucket.append(target)

    async def serve(self, online: Callable[[], trio.Event]) -> None:
        """Probe until cancelled, sending new probes only while ``online()`` is set. Checkpoints.

        Cancellation closes every probe's connection.
        """
        try:
            while True:
                self._now = now = trio.current_time()
                self._read(now)
                self._expire(now)
                if online().is_set():
                    await self._start_due(now)
                await self._sleep(now, online)
        finally:
            for _, target in self._ready.watched():
                self._close(target)
            self._ready.close()

    async def _sleep(self, now: float, online: Callable[[], trio.Event]) -> None:
        """Until the next tick while probes are in flight, else until the next is due (or one is scheduled)."""
        next_round = (round_of(now) + 1) * TICK
        if self._in_flight:
            await trio.sleep_until(next_round)
            return
        event = online()
        if not event.is_set():
            await event.wait()
            return
        self._wake = trio.Event()
        due = self._rounds[0] * TICK if self._rounds else math.inf
        with trio.move_on_at(max(due, next_round)):
            await self._wake.wait()

    async def _start_due(self, now: float) -> None:
        """Send every probe that is due: on its kept connection at once, else after opening one."""
        rounds, buckets, in_flight = self._rounds, self._buckets, self._in_flight
        this_round = round_of(now)  # the grid time the round is for (its wakeup may be a little late)
        while rounds and rounds[0] <= this_round:
            for target in buckets.pop(heapq.heappop(rounds)):
                target.due = target.scheduled
                target.deadline = now + target.limit
                if target.answers:
                    target.answers = []
                in_flight.add(target)
                if target.sock is not None:
                    target.reused = True
                    self._send(target, 0)
                    continue
                try:
                    await self._connect(target)
                except OSError as exc:
                    self._finish(
                        target,
                        ProbeResult(False, f"unreachable: cannot connect to {target.host}:{target.port}: {exc}"),
                    )

    async def _connect(self, target: Target) -> None:
        """Open ``target``'s connection without waiting for it (its first request goes when writable)."""
        host = target.host
        try:
            family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
            address: tuple[str, int] = (host, target.port)
        except ValueError:
            infos = await trio.to_thread.run_sync(socket.getaddrinfo, host, target.port, 0, socket.SOCK_STREAM)
            family, sockaddr = infos[0][0], infos[0][4]
            address = (str(sockaddr[0]), int(sockaddr[1]))
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        error = sock.connect_ex(address)
        if error not in (0, errno.EINPROGRESS):
            sock.close()
            raise OSError(error, os.strerror(error))
        target.sock, target.connecting, target.reused = sock, True, False
        target.parser = StatusAnswers()
        self._ready.add(sock.fileno(), target, connecting=True)

    def _send(self, target: Target, index: int) -> None:
        sock, parser = target.sock, target.parser
        assert sock is not None and parser is not None
        parser.expect()
        target.waiting = True
        request = target.requests[index]
        try:
            sent = sock.send(request)
        except OSError as exc:
            if target.reused and not target.answers:
                self._retry_fresh(target)
                return
            self._fail(target, f"unreachable: {exc}")
            return
        if sent != len(request):  # a probe's request is a few hundred bytes: an empty socket buffer takes it
            self._fail(target, "unreachable: the request did not fit in the socket's buffer")

    def _read(self, now: float) -> None:
        if not len(self._ready):
            return
        for _, target in self._ready.ready():
            if target.sock is None:  # closed by an earlier target's step in this round
                continue
            if target.connecting:
                self._connected(target)
            else:
                while self._receive(target) == RECEIVE_SIZE:  # more may be left unread, and not reported again
                    pass

    def _connected(self, target: Target) -> None:
        """Ready while connecting: no data comes before the connection is made, so it is made or failed."""
        sock = target.sock
        assert sock is not None
        error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            self._fail(target, f"unreachable: cannot connect to {target.host}:{target.port}: {os.strerror(error)}")
            return
        target.connecting = False
        self._ready.connected(sock.fileno())
        self._send(target, 0)

    def _receive(self, target: Target) -> int:
        """Read what ``target``'s socket has; return the bytes read (0: none, or the connection ended).

        A full read may leave more unread, which the edge-triggered set does not report
        again: the caller reads again.
        """
        sock = target.sock
        if sock is None:  # closed by the read before
            return 0
        error: OSError | None = None
        try:
            data = sock.recv(RECEIVE_SIZE)
        except BlockingIOError:
            return 0
        except OSError as exc:
            data, error = b"", exc
        parser = target.parser
        if not target.waiting or parser is None:  # an idle kept connection: the server closed it (or sent unasked)
            self._close(target)
            return 0
        if data:
            try:
                parser.feed(data)
            except AnswerError as exc:
                self._fail(target, f"unreachable: bad answer: {exc}")
                return 0
            if parser.size > ANSWER_BYTES:
                self._fail(target, f"the answer is over {ANSWER_BYTES} bytes")
                return 0
        elif target.reused and not target.answers and not parser.head_done:
            self._retry_fresh(target)  # closed while idle, before our request reached it
            return 0
        elif error is not None:
            self._fail(target, f"unreachable: the read failed: {error}")
            return 0
        elif not parser.closed():
            self._fail(target, "unreachable: the server closed the connection without answering")
            return 0
        if parser.complete:
            self._answered(target, parser)
        return len(data)

    def _answered(self, target: Target, parser: StatusAnswers) -> None:
        target.waiting = False
        status, body = parser.status, parser.body
        if not parser.reusable:
            self._close(target)
        if len(target.requests) == 1 and 200 <= status < 300:  # the usual probe: one path, and it passed
            self._finish(target, PASSED)
            return
        target.answers.append((status, body[0] if len(body) == 1 else b"".join(body)))
        index = len(target.answers)
        if index < len(target.requests) and 200 <= target.answers[0][0] < 300:
            if target.sock is None:  # the server closed after the first answer: the rest adds nothing vital
                self._finish(target, judge(target.kind, tuple(target.answers)))
            else:
                self._send(target, index)
            return
        self._finish(target, judge(target.kind, tuple(target.answers)))

    def _retry_fresh(self, target: Target) -> None:
        """The kept connection was closed by the server: the probe goes again on a new one (this round)."""
        self._close(target)
        self._in_flight.discard(target)
        self._push(target, target.due)  # due already: the round under way takes it again

    def _expire(self, now: float) -> None:
        for target in [t for t in self._in_flight if t.deadline <= now]:
            self._fail(target, f"no answer within {target.limit:g} s")

    def _fail(self, target: Target, reason: str) -> None:
        self._close(target)
        self._finish(target, ProbeResult(False, reason))

    def _finish(self, target: Target, result: ProbeResult) -> None:
        """Count the probe's result; schedule the next an interval later (see :data:`TICK`)."""
        self._in_flight.discard(target)
        target.waiting = False
        self.probes += 1
        now = self._now
        interval = target.done(result, now)
        self._push(target, max(target.due + interval, now + interval - 2 * TICK))

    def _close(self, target: Target) -> None:
        sock = target.sock
        if sock is None:
            return
        self._ready.discard(sock.fileno(), target)
        sock.close()
        target.sock = None
        target.parser = None
        target.waiting = target.connecting = False


def _unset(result: ProbeResult, now: float) -> float:
    raise RuntimeError("Target.done was not set before the target was scheduled")

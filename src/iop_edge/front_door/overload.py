"""Overload decisions of the Edge's front door: a pure decision unit, plus the loop-lag sampler.

Why shedding exists next to the admission queue: under a flood of clients that
retry at once, the queue is full and every extra request is refused anyway
(429). What that refusal costs is the question: reading and parsing its body,
asking admission and counting it is CPU the event loop then lacks for the
admitted requests and for ``/healthz``. When the loop itself falls behind (its
lag over ``shed_loop_lag``) or too many connections are open
(``shed_connections``) *and* requests are already waiting in the queue (so
every backend slot is taken and a newcomer could only queue), a new
completion request is answered ``503 overloaded`` before its body is read --
the cheapest refusal there is. With an empty queue nothing is shed: a request
that could run at once is never turned away to save CPU, and admitted
requests and streams are never cut.

Hysteresis: once lag shedding starts it lasts until the lag falls under half
the threshold, so the decision does not flap with every lag sample.

Retry-After and pacing (:class:`ReturnSchedule`). Under a flood the Edge is
saturated whatever it does: 1,000 clients that retry 10 ms after each refusal
offer tens of thousands of requests a second, and no process answers that
many on one core. What protects the admitted requests is bounding the CPU spent
on refusals. So each refusal (``429 queue_full`` / ``queue_timeout``, ``503
overloaded``) books its client a *return time*: at least ``1 / refusal_rate``
after the return time booked before it -- refused clients are told to come
back at most ``refusal_rate`` per second -- and not before the queue ahead can
drain (``(waiting + 1) x recent service time / total capacity``) or 1 s has
passed, whichever is sooner. The ``Retry-After`` sent is the delay to the
return time or the drain time, whichever is longer, rounded up to whole
seconds (at least 1, at most ``max_retry_after``); and after a refusal answered
at once (not a ``queue_timeout``, whose client already waited) the listener
does not read the connection's next request before the delay to the return
time rounded up to whole seconds, plus :data:`RETURN_GRACE` (10 ms), at the next
step of a :data:`RETURN_GRID` (20 ms) grid: then a client that honours
``Retry-After`` has sent it, and it is read with the others due in that moment
(one wake-up of the loop for all). Such a client waits 10-30 ms more; one that
retries sooner waits in its socket buffer, costing the Edge no CPU; one that
retries after a second is held only as long as the refusal rate requires,
even when a slow backend makes the drain time long.
"""

from __future__ import annotations

import math
from typing import Literal, final

import attrs
import trio

from iop_edge.listener.server import ConnectionCounter
from iop_edge.status import OverloadStatus

Action = Literal["admit", "shed"]
ShedReason = Literal["loop_lag", "connections"]

SERVICE_TIME_WEIGHT = 0.1
"""Weight of the newest lease duration in the service-time average."""


@attrs.frozen(kw_only=True)
class OverloadPolicy:
    """The thresholds (config keys under ``overload`` in seconds/counts).

    Attributes:
        shed_loop_lag: event-loop lag (s) above which new requests are shed.
        shed_connections: open HTTP connections above which new requests are shed.
        max_connections: open HTTP connections past which new ones are closed at accept.
        max_retry_after: the largest ``Retry-After`` (s) the Edge advises.
        refusal_rate: refused clients told to come back per second, at most.
    """

    shed_loop_lag: float = 0.2
    shed_connections: int = 6144
    max_connections: int = 8192
    max_retry_after: int = 30
    refusal_rate: float = 1000.0


@final
class LoadShedder:
    """Decides, per new request, whether to shed it; keeps the figures ``/status`` shows.

    Args:
        policy: the thresholds.
        initial_service_time: the service time assumed before any lease ended (s).
    """

    __slots__ = ("policy", "loop_lag", "lag_shedding", "service_time", "shed_total", "last_reason")

    def __init__(self, policy: OverloadPolicy, initial_service_time: float = 1.0) -> None:
        self.policy = policy
        self.loop_lag = 0.0
        self.lag_shedding = False
        self.service_time = initial_service_time
        self.shed_total = 0
        self.last_reason: ShedReason | None = None

    def __repr__(self) -> str:
        state = "shedding" if self.lag_shedding else "admitting"
        return f"<LoadShedder {state}, lag {self.loop_lag * 1000:.1f} ms, {self.shed_total} shed>"

    def observe_lag(self, lag: float) -> None:
        """Record one loop-lag sample (s); starts or ends lag shedding (with hysteresis)."""
        self.loop_lag = max(0.0, lag)
        threshold = self.policy.shed_loop_lag
        if self.loop_lag > threshold:
            self.lag_shedding = True
        elif self.loop_lag < threshold / 2:
            self.lag_shedding = False

    def observe_service(self, duration: float) -> None:
        """Record how long one admitted request held its lease (s)."""
        self.service_time += SERVICE_TIME_WEIGHT * (max(0.0, duration) - self.service_time)

    def action(self, open_connections: int, waiting: int) -> Action:
        """Shed or admit a new request, given open connections and queued requests."""
        if waiting <= 0:
            return "admit"
        if self.lag_shedding:
            reason: ShedReason = "loop_lag"
        elif open_connections > self.policy.shed_connections:
            reason = "connections"
        else:
            return "admit"
        self.shed_total += 1
        self.last_reason = reason
        return "shed"


@final
class ReturnSchedule:
    """Books refused clients' return times, spread ``1 / rate`` apart (pure: ``now`` is given).

    Args:
        rate: return times per second, at most (``refusal_rate``).
        ceiling: the longest delay booked (s) (``max_retry_after``).
    """

    __slots__ = ("spacing", "ceiling", "last")

    def __init__(self, rate: float, ceiling: float) -> None:
        self.spacing = 1.0 / rate
        self.ceiling = ceiling
        self.last = -math.inf

    def __repr__(self) -> str:
        return f"<ReturnSchedule every {self.spacing * 1000:g} ms, last {self.last:.3f}>"

    def book(self, now: float, drain: float) -> float:
        """Book a return time no sooner than ``now + drain``; the delay until it (s).

        The delay is at most ``ceiling``: past it, returns bunch at the ceiling.
        """
        slot = min(max(self.last + self.spacing, now + drain), now + self.ceiling)
        self.last = slot
        return max(0.0, slot - now)


RETURN_GRACE = 0.01
"""Seconds a refused connection stays unread past the whole seconds of its booked delay, at least.

A client that honours ``Retry-After`` sends its next request that long after the
refusal (plus its own delays): reading the connection a little after that point
finds the request already there, read with every other one due in the same
moment, instead of waking the connection, finding nothing, and waiting for the
socket (a second wake-up and an epoll registration for each request).
"""

RETURN_GRID = 0.02
"""Seconds: a refused connection is read again at a multiple of this on the loop's clock (the
first after its booked delay in whole seconds plus :data:`RETURN_GRACE`), so the returns of a
flood come in one wake-up of the event loop every ``RETURN_GRID`` at most. A wake-up from idle
costs the Edge far more than the work of one refusal (150-250 us of CPU on the benchmark's box,
most of it the loop's own pass and the kernel's sleep and wake-up), so at 1,000 refusals a
second one wake-up per refusal would cost more than the refusals themselves."""


def _grid_pause(now: float, delay: float) -> float:
    """The pause from ``now`` to the first multiple of :data:`RETURN_GRID` at or after ``now + delay``."""
    return grid_step(now + delay) - now


def _whole_seconds(delay: float) -> int:
    """``delay`` rounded up to whole seconds, at least 1 (a float a hair over a whole second counts as it)."""
    return max(1, math.ceil(delay - 1e-6))


def drain_time(waiting: int, service_time: float, capacity: int) -> float:
    """Seconds until the queue ahead drains: ``(waiting + 1) x service_time / capacity`` (inf: no capacity)."""
    if capacity <= 0:
        return math.inf
    return (max(0, waiting) + 1) * max(0.0, service_time) / capacity


@final
class FrontDoor:
    """The Edge's overload state: the shedder, the listener's connections, the queued requests.

    ``waiting`` counts the requests of this Edge that are asking admission for a
    lease (queued, or about to be granted or refused), ``running`` those holding
    one; the API keeps both.
    """

    __slots__ = (
        "shedder",
        "connections",
        "waiting",
        "running",
        "returns",
        "passing",
        "passing_of",
        "passing_until",
    )

    def __init__(self, policy: OverloadPolicy) -> None:
        self.shedder = LoadShedder(policy)
        self.returns = ReturnSchedule(policy.refusal_rate, policy.max_retry_after)
        self.connections = ConnectionCounter(policy.max_connections)
        self.waiting = 0
        self.running = 0
        self.passing = 0  # let through on their heads and not asking yet (:meth:`let_through`)
        self.passing_of: dict[str | None, int] = {}  # the same, by tenant as the Edge names it
        self.passing_until = -math.inf  # when those counts lapse

    def __repr__(self) -> str:
        return f"<FrontDoor {self.shedder!r}, {self.connections!r}, {self.waiting} waiting>"

    def enter(self, tenant: str | None = None) -> Visit:
        """Count a new request (of ``tenant``) as asking for a lease; the :class:`Visit` moves and
        ends its count.

        A request let through on its head (:meth:`let_through`) stops counting as passing here.
        """
        self.waiting += 1
        self._arrived(tenant)
        return Visit(self)

    def let_through(self, now: float, tenant: str | None = None) -> None:
        """Count a request (of ``tenant``) let through on its head (not refused there): it will ask
        for a lease soon.

        Between the decision on a head and the request's :meth:`enter` there is at least a task
        switch: the pacer decides on every paused connection due at once in one pass, and a
        connection let through is read and parsed by its own task afterwards. Without this count
        every connection due in the pass that frees a place in the queue would be let through, and
        all but one refused by its task after all -- the dearest way to refuse (a wake-up and an
        h11 parse each). The count lapses :data:`PASSING_WINDOW` after the first request it holds
        (a request let through that never asks, a 404 say, holds a place no longer than that).
        """
        if now > self.passing_until:
            self.passing = 0
            self.passing_of.clear()
            self.passing_until = now + PASSING_WINDOW
        self.passing += 1
        self.passing_of[tenant] = self.passing_of.get(tenant, 0) + 1

    def gave_up(self, tenant: str | None = None) -> None:
        """A request (of ``tenant``) let through on its head ends before it asks for a lease (a bad
        body, an unknown field, the client gone): it stops counting as passing (:meth:`let_through`),
        so a burst of such requests does not read as a full queue."""
        self._arrived(tenant)

    def _arrived(self, tenant: str | None) -> None:
        """A request of ``tenant`` let through on its head asks now, or never will: not passing."""
        if self.passing > 0:
            self.passing -= 1
        count = self.passing_of.get(tenant, 0)
        if count > 1:
            self.passing_of[tenant] = count - 1
        elif count:
            del self.passing_of[tenant]

    def _passing(self, now: float) -> int:
        return self.passing if now <= self.passing_until else 0

    def in_transit(self, now: float) -> dict[str | None, int]:
        """The requests let through on their heads and not asking yet at ``now``, by tenant."""
        return self.passing_of if now <= self.passing_until else {}

    def shed(self, queue_depth: int) -> bool:
        """Whether to refuse a new request now (``503 overloaded``), counting it if so.

        ``queue_depth``: the requests queued for a lease in admission now. Those are
        the ones that wait (every slot of their model taken), not :attr:`waiting`,
        which also counts requests about to be granted a free slot -- under loop lag
        for a whole pass: when 512 streams started within a second on a loaded box,
        hundreds of those were in it at every moment and, with the lag over the
        threshold, a third of the streams were shed while most slots were free.
        """
        return self.shedder.action(self.connections.open, queue_depth) == "shed"

    def queue_full(self, max_queue: int, capacity: int, queue_depth: int, now: float) -> bool:
        """Whether a new request could only be refused ``429 queue_full`` (before its body is read).

        True when the queue holds ``max_queue`` waiters and the requests of this
        Edge already asking for a lease (``waiting``) fill it and every slot not
        leased (``capacity - running``). Counting the free slots this way, not
        only "every slot leased", also covers the moment after a lease ends: the
        slot is granted to a waiter at once, but ``running`` counts it only when
        that waiter's task runs -- under loop lag, a whole pass later. The
        requests let through on their heads at ``now`` and not asking yet
        (:meth:`let_through`) count as waiting and queued already.
        """
        passing = self._passing(now)
        free = max(0, capacity - self.running)
        return self.waiting + passing >= max_queue + free and queue_depth + passing >= max_queue

    def refusal(self, now: float, capacity: int) -> tuple[int, float]:
        """Book a refused client's return: ``(Retry-After in whole seconds, pause in s)``.

        The listener leaves the connection unread for the pause: the booked
        delay rounded up to whole seconds (what a client told that delay waits)
        plus :data:`RETURN_GRACE`, up to the next step of :data:`RETURN_GRID`:
        never more than the ``Retry-After`` plus both.
        """
        drain = drain_time(self.waiting, self.shedder.service_time, capacity)
        delay = self.returns.book(now, min(drain, 1.0))
        ceiling = self.shedder.policy.max_retry_after
        booked = min(_whole_seconds(delay), ceiling)
        return max(booked, _whole_seconds(min(drain, ceiling))), _grid_pause(now, booked + RETURN_GRACE)

    def status(self) -> OverloadStatus:
        """The ``overload`` part of ``/status`` (and of the overload gauges)."""
        shedder = self.shedder
        return OverloadStatus(
            shedding=shedder.lag_shedding or self.connections.open > shedder.policy.shed_connections,
            loop_lag_ms=round(shedder.loop_lag * 1000, 1),
            open_connections=self.connections.open,
            refused_connections=self.connections.refused,
            shed_requests=shedder.shed_total,
            waiting=self.waiting,
            service_time_ms=round(shedder.service_time * 1000, 1),
            paused_connections=self.connections.paused,
        )


PASSING_WINDOW = 0.01
"""Seconds a request let through on its head counts as passing, at most, if it does not ask for a
lease before (:meth:`FrontDoor.let_through`): its task runs within a pass or two of the loop."""


LAG_INTERVAL = 0.05
"""Seconds between two loop-lag samples, at least."""


def grid_step(at: float) -> float:
    """The first multiple of :data:`RETURN_GRID` at or after ``at`` (trio's clock)."""
    return math.ceil(at / RETURN_GRID) * RETURN_GRID


async def watch_loop_lag(shedder: LoadShedder, interval: float = LAG_INTERVAL) -> None:
    """Sample the event loop's lag into ``shedder`` until cancelled (the one trio part here).

    The lag is how late a timer wakes: the time every runnable task took before
    this one ran again. The timer is set ``interval`` ahead, on the next step of
    the :data:`RETURN_GRID` grid: under a flood, paced connections are read on
    the same steps, so the sampler's wake-ups are theirs (one wake-up of the
    loop, not two). Checkpoints; cancellation just stops it.
    """
    while True:
        due = grid_step(trio.current_time() + interval)
        await trio.sleep_until(due)
        shedder.observe_lag(trio.current_time() - due)


@final
class Visit:
    """One request's place in the :class:`FrontDoor`'s counts.

    Asking (``waiting``) from :meth:`FrontDoor.enter` until its first grant,
    then running (``running``) until :meth:`leave`, retries included. Every
    method is idempotent, so each count is given back exactly once.
    """

    __slots__ = ("door", "asking", "granted")

    def __init__(self, door: FrontDoor) -> None:
        self.door = door
        self.asking = True
        self.granted = False

    def grant(self) -> None:
        """The request holds a lease: from asking to running (the first time only)."""
        if self.asking:
            self.stop_asking()
            self.door.running += 1
            self.granted = True

    def stop_asking(self) -> None:
        """The request no longer asks for a lease (granted or refused)."""
        if self.asking:
            self.asking = False
            self.door.waiting -= 1

    def leave(self) -> None:
        """The request is over: give back whichever count it holds."""
        self.stop_asking()
        if self.granted:
            self.granted = False
            self.door.running -= 1

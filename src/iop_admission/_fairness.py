"""Tenants, priority bands and weighted fair share: the order of grants.

Sans-I/O and independent of providers: a caller enqueues items for tenants,
asks :meth:`FairShare.grant` for the next item among those a predicate says
are dispatchable, and reports the end of each grant. The rule:

* the highest priority band with a dispatchable waiter is served first;
* within a band, start-time fair queuing: each tenant carries a virtual
  finish tag ``F``; the tenant with the smallest tag among those with a
  dispatchable waiter is served, then ``F += cost / weight``; the band's
  virtual time ``V`` becomes the served start tag. A tenant that turns
  backlogged again starts at ``max(F, V)``: idle time banks no credit;
* within a tenant, FIFO; a waiter the predicate refuses (a long request
  blocked on long slots) is passed over, never blocking the one behind it nor
  any other tenant's (no head-of-line); the tenant keeps its tag meanwhile,
  so that waiter is served from its place when it can run, but should it
  leave unserved (a timeout, a cancel) the tag is lifted to ``V``: its other
  waiters bank no credit from that wait;
* a tenant at ``max_in_flight`` is not served; ``max_queue`` refuses its
  newcomers with :class:`TenantLimitExceeded`;
* cost is 1 per request, or an estimate in tokens reserved at the grant and
  settled with the actual usage when the run ends (:meth:`settle`).

With one tenant every grant is the earliest dispatchable waiter: today's
global FIFO. Bounds (proven in ``tests/admission/test_fairness_machine.py``):
two tenants of a band backlogged over an interval differ in served
``cost / weight`` by at most ``c_i / w_i + c_j / w_j`` (``c`` the largest cost
of one request), and a backlogged tenant ``i`` is granted within
``sum(floor(w_j / w_i) + 1 for j != i)`` grants of its band under request cost.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field, replace

from ._errors import ConfigError, TenantLimitExceeded

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class TenantSpec:
    """One configured tenant: share weight, priority band and quotas."""

    name: str
    weight: float = 1.0
    priority: int = 0
    max_in_flight: int | None = None
    max_queue: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if not self.name:
            problems.append("tenant name must not be empty")
        if not self.weight > 0:
            problems.append(f"tenant {self.name!r}: weight must be > 0")
        for key in ("max_in_flight", "max_queue"):
            value = getattr(self, key)
            if value is not None and value < 1:
                problems.append(f"tenant {self.name!r}: {key} must be >= 1")
        if problems:
            raise ConfigError(problems)


@dataclass(eq=False)
class Ticket:
    """One item of one tenant, from enqueue to release."""

    tenant: str
    item: Hashable
    cost: float
    seq: int
    granted: bool = False
    done: bool = False
    charged: float = 0.0
    klass: Hashable = None


@dataclass(eq=False)
class _Tenant:
    spec: TenantSpec
    finish: float = 0.0
    queue: deque[Ticket] = field(default_factory=deque)
    in_flight: int = 0
    served: float = 0.0
    grants: int = 0
    version: int = 0
    # Tickets by class (items of one class are dispatchable together or not at all), in
    # arrival order with lazy deletion; ``unclassed`` counts queued tickets of no class.
    classes: dict[Hashable, deque[Ticket]] = field(default_factory=dict)
    unclassed: int = 0


class FairShare:
    """The grant order over tenants: bands, then fair share, then FIFO."""

    def __init__(self, tenants: Iterable[TenantSpec] = (), queue_limit: int | None = None) -> None:
        self._tenants: dict[str, _Tenant] = {}
        self._configured: frozenset[str] = frozenset()  # the tenants of the config (and default)
        self._vtime: dict[int, float] = {}
        # (-priority, finish, head seq, version, name); an entry is live while its version is the tenant's
        self._heap: list[tuple[int, float, int, int, str]] = []
        self._seq = itertools.count()
        self.queue_limit = queue_limit
        self.configure(tenants)

    # -- configuration --------------------------------------------------------

    def configure(self, tenants: Iterable[TenantSpec]) -> None:
        """Apply a new tenant set live: queues, leases and tags are kept.

        A tenant dropped from the config keeps its waiters and leases until
        they leave (it serves them under the default tenant's spec meanwhile,
        then goes away); new items naming it go to the default tenant at once.
        """
        specs = {t.name: t for t in tenants}
        specs.setdefault(DEFAULT_TENANT, TenantSpec(DEFAULT_TENANT))
        self._configured = frozenset(specs)
        for name, spec in specs.items():
            state = self._tenants.get(name)
            if state is None:
                self._tenants[name] = _Tenant(spec)
            else:
                self._respec(state, spec)
        for name, state in list(self._tenants.items()):
            if name not in specs:
                if state.queue or state.in_flight:
                    self._respec(state, replace(specs[DEFAULT_TENANT], name=name))
                else:
                    del self._tenants[name]
        self._heap = []
        for state in self._tenants.values():
            self._touch(state)

    def _respec(self, state: _Tenant, spec: TenantSpec) -> None:
        """Give a tenant a new spec; its lead over its band's virtual time is rescaled.

        The lead is cost already charged at the old weight; kept as is, a
        tenant whose weight rose would pay its last grant at the old rate.
        """
        old = state.spec
        lead = max(0.0, state.finish - self._vtime.get(old.priority, 0.0))
        state.finish = self._vtime.get(spec.priority, 0.0) + lead * old.weight / spec.weight
        state.spec = spec

    def tenant_of(self, name: str | None) -> str:
        """The configured tenant called ``name``, else the default tenant (a dropped one too)."""
        return name if name is not None and name in self._configured else DEFAULT_TENANT

    # -- waiters --------------------------------------------------------------

    def enqueue(
        self,
        tenant: str,
        item: Hashable,
        cost: float = 1.0,
        seq: int | None = None,
        *,
        quota: bool = True,
        klass: Hashable = None,
    ) -> tuple[Ticket, list[Ticket]]:
        """Queue ``item``; returns its ticket and any sheddable tickets evicted for it.

        ``seq``: the item's arrival number (default: the next of this
        FairShare's own count); an item older than the tenant's newest waiter
        (a retry keeping its arrival place) goes in at its place. ``quota``
        False skips the tenant's ``max_queue`` (a request admitted once already).
        ``klass``: items of one class are dispatchable together or not at all
        (one model group and kind): a grant then looks at the head of each of
        the tenant's classes instead of scanning its queue.

        Raises :class:`TenantLimitExceeded` when the tenant's ``max_queue`` is
        reached, or when the queue is full and nothing of a lower negative
        band can make room.
        """
        state = self._tenants[self.tenant_of(tenant)]
        spec = state.spec
        if quota:
            self.check_queue(spec.name)
        shed: list[Ticket] = []
        if self.queue_limit is not None and self.queue_depth >= self.queue_limit:
            victim = self.shed_victim(spec.priority)
            if victim is None:
                raise TenantLimitExceeded(spec.name, "shed" if spec.priority < 0 else "queue", self.queue_limit)
            self.cancel(victim)
            shed.append(victim)
        if not state.queue:
            band = spec.priority
            state.finish = max(state.finish, self._vtime.get(band, 0.0))
        ticket = Ticket(spec.name, item, cost, next(self._seq) if seq is None else seq, klass=klass)
        _insert(state.queue, ticket)
        if klass is None:
            state.unclassed += 1
        else:
            _insert(state.classes.setdefault(klass, deque()), ticket)
        queue = state.queue
        if queue[0] is ticket:
            self._touch(state)
        return ticket, shed

    def check_queue(self, tenant: str) -> None:
        """Raise :class:`TenantLimitExceeded` if ``tenant`` has ``max_queue`` waiters already."""
        spec = self._tenants[self.tenant_of(tenant)].spec
        if spec.max_queue is not None and len(self._tenants[spec.name].queue) >= spec.max_queue:
            raise TenantLimitExceeded(spec.name, "max_queue", spec.max_queue)

    def can_run(self, tenant: str) -> bool:
        """Whether ``tenant`` is under its ``max_in_flight``."""
        state = self._tenants[self.tenant_of(tenant)]
        cap = state.spec.max_in_flight
        return cap is None or state.in_flight < cap

    def admit(self, tenant: str, item: Hashable, cost: float = 1.0, seq: int = 0) -> Ticket:
        """Charge a grant made at once, without queueing (nobody of a band could use the slot).

        The item starts at ``max(F, V)`` as if it had queued and been served
        first: the same tags and counts as :meth:`enqueue` then :meth:`grant`.
        """
        state = self._tenants[self.tenant_of(tenant)]
        spec = state.spec
        band = spec.priority
        start = state.finish if state.queue else max(state.finish, self._vtime.get(band, 0.0))
        self._vtime[band] = max(self._vtime.get(band, 0.0), start)
        state.finish = start + cost / spec.weight
        state.in_flight += 1
        state.served += cost
        state.grants += 1
        ticket = Ticket(spec.name, item, cost, seq, granted=True, charged=cost)
        self._touch(state)
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """A queued ticket leaves without a grant (timeout, cancel, shed)."""
        if ticket.granted or ticket.done:
            return
        ticket.done = True
        state = self._tenants[ticket.tenant]
        _left(state, ticket)
        head = state.queue[0] is ticket
        state.queue.remove(ticket)
        now = self._vtime.get(state.spec.priority, 0.0)
        if state.finish < now:
            # Its tag stayed behind the band's time while its waiters were passed over; that place was
            # the passed-over waiter's, which leaves: the tenant's others bank no credit from it.
            state.finish = now
            head = True
        if head:
            self._touch(state)
        self._forget_drained(state)

    def shed_victim(self, priority: int) -> Ticket | None:
        """The newest waiter of the lowest negative band below ``priority``."""
        worst: Ticket | None = None
        worst_band = min(priority, 0)
        for state in self._tenants.values():
            band = state.spec.priority
            if not state.queue or (band >= worst_band and worst is None) or band > worst_band:
                continue
            last = state.queue[-1]
            if worst is None or band < worst_band or last.seq > worst.seq:
                worst, worst_band = last, band
        return worst

    # -- grants ---------------------------------------------------------------

    def grant(self, dispatchable: Callable[[Hashable], bool] = lambda item: True) -> Ticket | None:
        """Mark granted and charge the :meth:`choose` ticket, or None."""
        if type(self).choose is FairShare.choose:
            ticket = self._choose(dispatchable, True)
        else:  # a subclass's own order (the FIFO control of the tests)
            ticket = self.choose(dispatchable)
        if ticket is None:
            return None
        state = self._tenants[ticket.tenant]
        band = state.spec.priority
        self._vtime[band] = max(self._vtime.get(band, 0.0), state.finish)
        queue = state.queue
        if queue[0] is ticket:
            queue.popleft()
        else:
            queue.remove(ticket)
        ticket.granted = True
        _left(state, ticket)
        state.finish += ticket.cost / state.spec.weight
        state.in_flight += 1
        state.served += ticket.cost
        state.grants += 1
        ticket.charged = ticket.cost
        self._touch(state)
        return ticket

    def choose(self, dispatchable: Callable[[Hashable], bool]) -> Ticket | None:
        """The ticket the ordering rule grants next, without granting it."""
        return self._choose(dispatchable, False)

    def _choose(self, dispatchable: Callable[[Hashable], bool], granting: bool) -> Ticket | None:
        """:meth:`choose`; ``granting``: the chosen tenant's entry is left out (its grant re-keys it)."""
        chosen: Ticket | None = None
        passed: list[tuple[int, float, int, int, str]] = []
        heap = self._heap
        tenants = self._tenants
        while heap and chosen is None:
            entry = heapq.heappop(heap)
            state = tenants.get(entry[4])
            if state is None or state.version != entry[3]:
                continue  # stale
            chosen = _first_runnable(state, dispatchable)
            if chosen is None or not granting:
                passed.append(entry)
        for entry in passed:
            heapq.heappush(heap, entry)
        return chosen

    def settle(self, ticket: Ticket, actual: float) -> None:
        """Replace a granted ticket's reserved cost with the cost it used.

        A refund moves the tenant's tag back, but not behind its band's virtual
        time: like an idle tenant, it banks no credit over the others. A
        tenant dropped from the config and gone since has nothing to charge.
        """
        state = self._tenants.get(ticket.tenant)
        if state is None:
            ticket.charged = actual
            return
        delta = actual - ticket.charged
        state.finish = max(state.finish + delta / state.spec.weight, self._vtime.get(state.spec.priority, 0.0))
        state.served += delta
        ticket.charged = actual
        self._touch(state)

    def release(self, ticket: Ticket) -> None:
        """A granted ticket's run ended; frees its tenant's in-flight slot."""
        if not ticket.granted or ticket.done:
            return
        ticket.done = True
        state = self._tenants[ticket.tenant]
        state.in_flight -= 1
        cap = state.spec.max_in_flight
        if cap is not None and state.in_flight < cap <= state.in_flight + 1:
            self._touch(state)  # back under its cap: it may be served again (else its heap entry stands)
        self._forget_drained(state)

    def _forget_drained(self, state: _Tenant) -> None:
        """A tenant dropped from the config goes away with its last waiter or lease."""
        name = state.spec.name
        if not state.queue and not state.in_flight and name not in self._configured:
            del self._tenants[name]

    def _touch(self, state: _Tenant) -> None:
        """Re-key a tenant in the heap after its head, tag, cap or spec changed."""
        state.version += 1
        spec = state.spec
        if state.queue and (spec.max_in_flight is None or state.in_flight < spec.max_in_flight):
            entry = (-spec.priority, state.finish, state.queue[0].seq, state.version, spec.name)
            heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._tenants) + 64:
            self._heap = [e for e in self._heap if self._live(e)]
            heapq.heapify(self._heap)

    def _live(self, entry: tuple[int, float, int, int, str]) -> bool:
        state = self._tenants.get(entry[4])
        return state is not None and state.version == entry[3]

    # -- reading --------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return sum(len(s.queue) for s in self._tenants.values())

    def spec(self, tenant: str) -> TenantSpec:
        return self._tenants[tenant].spec

    def tenants(self) -> list[str]:
        return list(self._tenants)

    def queued(self, tenant: str) -> tuple[Ticket, ...]:
        """The tenant's waiters in arrival order."""
        return tuple(self._tenants[tenant].queue)

    def waiting(self, tenant: str) -> int:
        return len(self._tenants[tenant].queue)

    def in_flight(self, tenant: str) -> int:
        return self._tenants[tenant].in_flight

    def served(self, tenant: str) -> float:
        """Cost charged to the tenant so far (tokens after settlement in token mode)."""
        return self._tenants[tenant].served

    def grants(self, tenant: str) -> int:
        return self._tenants[tenant].grants


def _ticket_seq(ticket: Ticket) -> int:
    return ticket.seq


def _insert(queue: deque[Ticket], ticket: Ticket) -> None:
    """Put ``ticket`` in ``queue`` at its arrival place (the end, unless it is a retry)."""
    if queue and queue[-1].seq > ticket.seq:
        queue.insert(bisect.bisect_left(queue, ticket.seq, key=_ticket_seq), ticket)
    else:
        queue.append(ticket)


def _left(state: _Tenant, ticket: Ticket) -> None:
    """``ticket`` (granted or done) left the tenant's queue: its class drops its dead front."""
    if ticket.klass is None:
        state.unclassed -= 1
        return
    members = state.classes.get(ticket.klass)
    if members is None:
        return
    while members and (members[0].granted or members[0].done):
        members.popleft()
    if not members:
        del state.classes[ticket.klass]


def _first_runnable(state: _Tenant, dispatchable: Callable[[Hashable], bool]) -> Ticket | None:
    """The tenant's earliest dispatchable ticket: the earliest dispatchable head of its classes.

    Within a class, if the head cannot run nobody behind it can; so this costs
    the number of the tenant's classes, not its queue, unless some ticket has no class.
    """
    queue = state.queue
    head = queue[0]
    if dispatchable(head.item):
        return head
    if state.unclassed:
        return next((t for t in queue if dispatchable(t.item)), None)
    best: Ticket | None = None
    classes = state.classes
    for key in tuple(classes):
        members = classes[key]
        while members and (members[0].granted or members[0].done):
            members.popleft()
        if not members:
            del classes[key]
            continue
        first = members[0]
        if (best is None or first.seq < best.seq) and dispatchable(first.item):
            best = first
    return best

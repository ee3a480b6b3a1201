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
  any other tenant's (no head-of-line);
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


@dataclass(eq=False)
class _Tenant:
    spec: TenantSpec
    finish: float = 0.0
    queue: deque[Ticket] = field(default_factory=deque)
    in_flight: int = 0
    served: float = 0.0
    grants: int = 0


class FairShare:
    """The grant order over tenants: bands, then fair share, then FIFO."""

    def __init__(self, tenants: Iterable[TenantSpec] = (), queue_limit: int | None = None) -> None:
        self._tenants: dict[str, _Tenant] = {}
        self._vtime: dict[int, float] = {}
        self._seq = itertools.count()
        self.queue_limit = queue_limit
        self.configure(tenants)

    # -- configuration --------------------------------------------------------

    def configure(self, tenants: Iterable[TenantSpec]) -> None:
        """Apply a new tenant set live: queues, leases and tags are kept.

        A tenant dropped from the config keeps its waiters and leases until
        they leave; it serves under the default tenant's spec meanwhile.
        """
        specs = {t.name: t for t in tenants}
        specs.setdefault(DEFAULT_TENANT, TenantSpec(DEFAULT_TENANT))
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
        """The configured tenant called ``name``, else the default tenant."""
        return name if name is not None and name in self._tenants else DEFAULT_TENANT

    # -- waiters --------------------------------------------------------------

    def enqueue(self, tenant: str, item: Hashable, cost: float = 1.0) -> tuple[Ticket, list[Ticket]]:
        """Queue ``item``; returns its ticket and any sheddable tickets evicted for it.

        Raises :class:`TenantLimitExceeded` when the tenant's ``max_queue`` is
        reached, or when the queue is full and nothing of a lower negative
        band can make room.
        """
        state = self._tenants[self.tenant_of(tenant)]
        spec = state.spec
        if spec.max_queue is not None and len(state.queue) >= spec.max_queue:
            raise TenantLimitExceeded(spec.name, "max_queue", spec.max_queue)
        shed: list[Ticket] = []
        if self.queue_limit is not None and self.queue_depth >= self.queue_limit:
            victim = self._shed_victim(spec.priority)
            if victim is None:
                raise TenantLimitExceeded(spec.name, "shed" if spec.priority < 0 else "queue", self.queue_limit)
            self.cancel(victim)
            shed.append(victim)
        if not state.queue:
            band = spec.priority
            state.finish = max(state.finish, self._vtime.get(band, 0.0))
        ticket = Ticket(spec.name, item, cost, next(self._seq))
        state.queue.append(ticket)
        return ticket, shed

    def cancel(self, ticket: Ticket) -> None:
        """A queued ticket leaves without a grant (timeout, cancel, shed)."""
        if ticket.granted or ticket.done:
            return
        ticket.done = True
        self._tenants[ticket.tenant].queue.remove(ticket)

    def _shed_victim(self, priority: int) -> Ticket | None:
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
        ticket = self.choose(dispatchable)
        if ticket is None:
            return None
        state = self._tenants[ticket.tenant]
        band = state.spec.priority
        self._vtime[band] = max(self._vtime.get(band, 0.0), state.finish)
        state.queue.remove(ticket)
        state.finish += ticket.cost / state.spec.weight
        state.in_flight += 1
        state.served += ticket.cost
        state.grants += 1
        ticket.granted = True
        ticket.charged = ticket.cost
        return ticket

    def choose(self, dispatchable: Callable[[Hashable], bool]) -> Ticket | None:
        """The ticket the ordering rule grants next, without granting it."""
        best: tuple[int, float, int] | None = None
        chosen: Ticket | None = None
        for state in self._tenants.values():
            spec = state.spec
            if not state.queue or (spec.max_in_flight is not None and state.in_flight >= spec.max_in_flight):
                continue
            if best is not None and -spec.priority > best[0]:
                continue
            for ticket in state.queue:
                if dispatchable(ticket.item):
                    key = (-spec.priority, state.finish, ticket.seq)
                    if best is None or key < best:
                        best, chosen = key, ticket
                    break
        return chosen

    def settle(self, ticket: Ticket, actual: float) -> None:
        """Replace a granted ticket's reserved cost with the cost it used."""
        state = self._tenants[ticket.tenant]
        delta = actual - ticket.charged
        state.finish += delta / state.spec.weight
        state.served += delta
        ticket.charged = actual

    def release(self, ticket: Ticket) -> None:
        """A granted ticket's run ended; frees its tenant's in-flight slot."""
        if not ticket.granted or ticket.done:
            return
        ticket.done = True
        self._tenants[ticket.tenant].in_flight -= 1

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

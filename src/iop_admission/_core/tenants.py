"""The tenancy part of the admission core: the FairShare order, tickets, quotas, settlement.

The core keeps its per-group queues in arrival order whatever
the tenants; with tenants configured, the *order of grants* among the waiters
that can run is :class:`~iop_admission._fairness.FairShare`'s (bands, then
start-time fair queuing by weight, then FIFO within a tenant), and each lease
and waiter carries a ticket charged to its tenant. Without tenants there is
no :class:`Tenancy` at all and every decision is the global FIFO of before:
:class:`Tenants` is the part :class:`~iop_admission.core.AdmissionState` holds,
and answers for both cases.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

from iop_admission._errors import QueueFull, TenantLimitExceeded
from iop_admission._fairness import FairShare, TenantSpec
from iop_admission._snapshot import TenantSnapshot

from .records import Lease, Waiter

if TYPE_CHECKING:
    from .slots import ProviderSlot

RECENT_GRANTS = 1000
"""Grants the ``share`` of a tenant row is measured over (the latest ones)."""


def klass_of(waiter: Waiter) -> Hashable:
    """The FairShare class of ``waiter``: waiters of one model key and kind share their
    candidates, so they can run together or not at all; a queued retry has its own.

    A retry's key is a 1-tuple: it never equals a ``(model, long)`` pair, whatever the
    model is called (``("retry", 1)`` would be the long class of a model ``"retry"``).
    """
    if waiter.attempt > 1:
        return (waiter.seq,)
    return (waiter.model, waiter.long)


class Tenancy:
    """The tenants of a pool: their FairShare and a window of recent grants."""

    __slots__ = ("fair", "specs", "_recent", "_counts")

    def __init__(self, specs: tuple[TenantSpec, ...]) -> None:
        self.specs = specs
        self.fair = FairShare(specs)
        self._recent: deque[str] = deque()
        self._counts: Counter[str] = Counter()

    def configure(self, specs: tuple[TenantSpec, ...]) -> bool:
        """Apply new specs live (tickets, tags and counts kept); whether anything changed."""
        if specs == self.specs:
            return False
        self.specs = specs
        self.fair.configure(specs)
        return True

    def requeue(self, waiters: Iterable[Waiter]) -> None:
        """Give ``waiters`` (queued before tenants were configured) tickets, in arrival order."""
        for w in waiters:
            w.tenant = self.fair.tenant_of(w.tenant)
            w._ticket, _ = self.fair.enqueue(w.tenant, w, w.cost, w.seq, quota=False, klass=klass_of(w))

    def note_grant(self, tenant: str) -> None:
        recent = self._recent
        recent.append(tenant)
        self._counts[tenant] += 1
        if len(recent) > RECENT_GRANTS:
            old = recent.popleft()
            self._counts[old] -= 1

    def rows(self) -> tuple[TenantSnapshot, ...]:
        """One row per tenant, configured ones in config order, then ``default`` and any draining."""
        fair = self.fair
        total = len(self._recent)
        names = dict.fromkeys((*(s.name for s in self.specs), *fair.tenants()))
        rows = []
        for name in names:
            spec = fair.spec(name)
            rows.append(
                TenantSnapshot(
                    name=name,
                    weight=spec.weight,
                    priority=spec.priority,
                    max_in_flight=spec.max_in_flight,
                    max_queue=spec.max_queue,
                    waiting=fair.waiting(name),
                    in_flight=fair.in_flight(name),
                    grants=fair.grants(name),
                    share=self._counts[name] / total if total else 0.0,
                    cost_charged=fair.served(name),
                )
            )
        return tuple(rows)


class Tenants:
    """The tenants of the core, or none: who is charged for a lease or waiter, and who may run.

    Without tenants (``tenancy`` is None) every answer is the global FIFO's: anyone may
    run, nothing is charged beyond the lease's own ``tenant`` and ``cost``.
    """

    __slots__ = ("tenancy",)

    def __init__(self) -> None:
        self.tenancy: Tenancy | None = None

    def configure(
        self, specs: tuple[TenantSpec, ...], waiters: Iterable[Waiter], providers: Iterable[ProviderSlot]
    ) -> bool:
        """Put ``specs`` in force live (every lease and waiter kept); whether the order may have changed."""
        tenancy = self.tenancy
        if tenancy is not None and specs:
            return tenancy.configure(specs)
        if tenancy is None and specs:
            self.tenancy = Tenancy(specs)
            self.tenancy.requeue(waiters)
            return True
        if tenancy is not None:  # tenants gone: one global FIFO again
            self.tenancy = None
            for w in waiters:
                w._ticket = None
            for p in providers:
                for lease in p.leases.values():
                    lease._ticket = None
            return True
        return False

    def shed_victim(self, tenant: str, model: str, max_queue: int) -> Waiter:
        """The queue is full: the newest waiter of the lowest negative band below ``tenant``'s.

        Raises:
            TenantLimitExceeded: ``tenant`` is of a negative band and nothing lower waits (``"shed"``).
            QueueFull: nothing of a negative band below ``tenant``'s waits.
        """
        assert self.tenancy is not None
        fair = self.tenancy.fair
        priority = fair.spec(tenant).priority
        victim = fair.shed_victim(priority)
        if victim is None:
            if priority < 0:
                raise TenantLimitExceeded(tenant, "shed", max_queue)
            raise QueueFull(model, max_queue)
        w = victim.item
        assert isinstance(w, Waiter)
        return w

    def cancel(self, item: Lease | Waiter) -> None:
        """``item`` left without a grant: its ticket (if any) leaves FairShare."""
        if item._ticket is not None and self.tenancy is not None:
            self.tenancy.fair.cancel(item._ticket)

    def charge(self, lease: Lease, tenant: str, cost: float) -> None:
        """A lease granted at once: charge it to ``tenant`` (a ticket when tenants are configured)."""
        lease.tenant, lease.cost = tenant, cost
        tenancy = self.tenancy
        if tenancy is not None:
            lease._ticket = tenancy.fair.admit(tenant, lease.id, cost, lease.arrival)
            lease.tenant = lease._ticket.tenant
            tenancy.note_grant(lease.tenant)

    def ticket_waiter(self, waiter: Waiter, tenant: str, cost: float) -> None:
        waiter.tenant, waiter.cost = tenant, cost
        if self.tenancy is not None:
            waiter._ticket, _ = self.tenancy.fair.enqueue(
                tenant, waiter, cost, waiter.seq, quota=False, klass=klass_of(waiter)
            )
            waiter.tenant = waiter._ticket.tenant

    def can_run(self, tenant: str) -> bool:
        return self.tenancy is None or self.tenancy.fair.can_run(tenant)

    def release_ticket(self, lease: Lease) -> bool:
        """Free ``lease``'s tenant slot; whether a tenant at its ``max_in_flight`` with waiters got room."""
        ticket = lease._ticket
        if ticket is None or self.tenancy is None:
            return False
        fair = self.tenancy.fair
        capped = not fair.can_run(ticket.tenant)
        fair.release(ticket)
        return capped and fair.waiting(ticket.tenant) > 0

    def settle(self, lease: Lease, actual: float) -> None:
        """Replace the cost reserved for ``lease`` with the cost it used ([tenant-token-cost])."""
        ticket = lease._ticket
        if ticket is not None and self.tenancy is not None:
            self.tenancy.fair.settle(ticket, actual)
        lease.cost = actual

    def rows(self) -> tuple[TenantSnapshot, ...]:
        """One row per tenant (see TenantSnapshot); empty without tenants."""
        return self.tenancy.rows() if self.tenancy is not None else ()

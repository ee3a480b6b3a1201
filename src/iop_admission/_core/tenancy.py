"""Tenants wired into the admission core: the FairShare order and what ``/status`` reads of it.

The core (``_core.py``) keeps its per-group queues in arrival order whatever
the tenants; with tenants configured, the *order of grants* among the waiters
that can run is :class:`~iop_admission._fairness.FairShare`'s (bands, then
start-time fair queuing by weight, then FIFO within a tenant), and each lease
and waiter carries a ticket charged to its tenant. Without tenants there is
no :class:`Tenancy` at all and every decision is the global FIFO of before.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable, Iterable

from iop_admission._fairness import FairShare, TenantSpec
from iop_admission._snapshot import TenantSnapshot

from .records import Waiter

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

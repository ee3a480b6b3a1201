"""The tenant side of the admission core: charging leases and waiters, quotas, shedding, settlement."""

from __future__ import annotations

from iop_admission._errors import Unavailable
from iop_admission._snapshot import TenantSnapshot

from .choice import reasons
from .records import Decision, Lease, Waiter
from .shared import StateCore
from .slots import ModelGroup
from .tenancy import klass_of


class TenantRules(StateCore):
    """Tenants in :class:`~iop_admission.core.AdmissionState` ([tenant-fair-share], [tenant-quotas])."""

    def settle(self, lease: Lease, actual: float) -> None:
        """Replace the cost reserved for ``lease`` with the cost it used ([tenant-token-cost]).

        Call once the run ended, with the usage the backend reported (tokens,
        or 1 for a request): the tenant's virtual time and charged total follow
        the cost used, not the estimate. Without tenants it only records it.
        """
        ticket = lease._ticket
        if ticket is not None and self._tenancy is not None:
            self._tenancy.fair.settle(ticket, actual)
        lease.cost = actual

    def drain_decisions(self) -> list[Decision]:
        """Decisions made by the last :meth:`request` or :meth:`retry` besides its result.

        A request that finds the queue full evicts the newest waiter of a lower
        negative band ([tenant-quotas]); a grant that starts a provider's probe
        stops it admitting, which may put the waiters of its model groups in
        panic mode, and they are granted ([outlier-ejection]). Carry these out
        like any decision.
        Do not change the list returned (empty, it is the state's own).
        """
        out = self._pending
        if out:
            self._pending = []
        return out

    def tenant_snapshots(self) -> tuple[TenantSnapshot, ...]:
        """One row per tenant (see TenantSnapshot); empty without tenants."""
        return self._tenancy.rows() if self._tenancy is not None else ()

    def _request_fair(
        self, group: ModelGroup, model: str, long: bool, now: float, tenant: str | None, cost: float
    ) -> Lease | Waiter:
        """:meth:`request` with tenants: quotas, shedding, then today's rule under FairShare's order."""
        assert self._tenancy is not None
        fair = self._tenancy.fair
        name = fair.tenant_of(tenant)
        best = group.best(long)
        if best is not None and fair.can_run(name):
            lease = self._grant(best, model, long, next(self._seq), now)
            self._charge(lease, name, cost)
            self._probe_started(lease)
            return lease
        if not group.could_run(long):
            raise Unavailable(model, long, reasons(group.providers, long, ()))
        fair.check_queue(name)
        if len(self._waiters) >= self._max_queue:
            self._shed_for(name, model)
        waiter = Waiter(next(self._seq), model, long, now, now + self._timeout)
        waiter._candidates = group.providers
        self._ticket_waiter(waiter, name, cost)
        group.enqueue(waiter)
        self._waiters[waiter.seq] = waiter
        return waiter

    def _charge(self, lease: Lease, tenant: str, cost: float) -> None:
        """A lease granted at once: charge it to ``tenant`` (a ticket when tenants are configured)."""
        lease.tenant, lease.cost = tenant, cost
        tenancy = self._tenancy
        if tenancy is not None:
            lease._ticket = tenancy.fair.admit(tenant, lease.id, cost, lease.arrival)
            lease.tenant = lease._ticket.tenant
            tenancy.note_grant(lease.tenant)

    def _ticket_waiter(self, waiter: Waiter, tenant: str, cost: float) -> None:
        waiter.tenant, waiter.cost = tenant, cost
        if self._tenancy is not None:
            waiter._ticket, _ = self._tenancy.fair.enqueue(
                tenant, waiter, cost, waiter.seq, quota=False, klass=klass_of(waiter)
            )
            waiter.tenant = waiter._ticket.tenant

    def _carry_cost(self, lease: Lease) -> tuple[str, float]:
        """A retry of ``lease``: its tenant and reserve (a retry is an attempt of its own, charged as one)."""
        return lease.tenant, lease.cost

    def _can_run(self, tenant: str) -> bool:
        return self._tenancy is None or self._tenancy.fair.can_run(tenant)

    def _release_ticket(self, lease: Lease) -> bool:
        """Free ``lease``'s tenant slot; whether a tenant at its ``max_in_flight`` with waiters got room."""
        ticket = lease._ticket
        if ticket is None or self._tenancy is None:
            return False
        fair = self._tenancy.fair
        capped = not fair.can_run(ticket.tenant)
        fair.release(ticket)
        return capped and fair.waiting(ticket.tenant) > 0

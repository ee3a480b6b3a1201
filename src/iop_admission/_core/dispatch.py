"""Grants: a lease counted on its provider, and the hand-off of room to the earliest waiters that can use it.

:class:`Dispatcher` is the step every rule of the core ends with when capacity
may have appeared (release, fence, connect, refresh, health): it grants queued
waiters, earliest first (or in the tenants' fair order), while one has a
dispatchable candidate. It reads the other parts through their own methods.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import cast

from iop_admission._config import ProviderKey

from .budgets import Budgets
from .choice import best_of, groups_of
from .health import Health
from .pool import Pool
from .queue import Queue
from .records import GRANTED, QUEUED, Decision, Granted, Lease, Waiter
from .slots import PROBE, ModelGroup, ProviderSlot
from .tenants import Tenancy, Tenants

_KINDS = (False, True)  # a group's waiters: normal, then long


class Dispatcher:
    """Grants leases and hands freed room to waiters (see the module docstring)."""

    __slots__ = ("_pool", "_queue", "_tenants", "_health", "_budgets", "_lease_ids")

    def __init__(self, pool: Pool, queue: Queue, tenants: Tenants, health: Health, budgets: Budgets) -> None:
        self._pool = pool
        self._queue = queue
        self._tenants = tenants
        self._health = health
        self._budgets = budgets
        self._lease_ids = itertools.count(1)

    def grant(
        self,
        p: ProviderSlot,
        model: str,
        long: bool,
        arrival: int,
        enqueue_time: float,
        attempt: int = 1,
        tried: tuple[ProviderKey, ...] = (),
        charge: Waiter | None = None,
        tokens: int | None = None,
    ) -> Lease:
        """A lease on ``p``; ``charge``: the waiter whose tenant, cost, tokens and ticket it carries
        (``tokens``: the request's, granted at once)."""
        lease = Lease(next(self._lease_ids), p, model, long, arrival, enqueue_time, attempt, tried)
        lease.tokens = charge.tokens if charge is not None else tokens
        self._pool.take(lease)
        if charge is not None:
            lease.tenant, lease.cost, lease._ticket = charge.tenant, charge.cost, charge._ticket
            if charge._passed is not None:  # reserved: its count and pin elsewhere go to the next
                self._budgets.forget(charge)
        if p.budgeted and self._queue.waiters:  # somebody may have been passed over
            self._budgets.note_pass(p, arrival, p.need(lease.tokens, long))
        if p.health is PROBE:
            self._health.start_probe(p, lease)
            p.reindex()
        elif p.indexed:  # only its load changed: only the heaps of its groups of several need it
            p.reindex()
        return lease

    def probe_started(self, lease: Lease) -> list[Decision]:
        """After an immediate grant: if it started a probe, grant whom it put in panic mode."""
        if lease.probe:
            return self.dispatch(g for g, _ in lease._slot.groups)
        return []

    def dispatch(self, groups: Iterable[ModelGroup]) -> list[Decision]:
        """Grant waiters of ``groups`` (:meth:`_round`), then those of the groups of each
        provider a grant started probing: one that stops admitting may put them in panic mode;
        and of each provider whose headroom a waiter granted elsewhere gave back ([token-ledger])."""
        decisions = self._round(groups)
        # A grant starts a probe only on a provider in the health's books (its probe was due).
        probed = (
            [d.lease._slot for d in decisions if type(d) is Granted and d.lease.probe] if self._health.unhealthy else []
        )
        budgets = self._budgets
        freed = budgets.take_unpinned() if budgets.unpinned else []
        while probed or freed:  # one probe per ejection, one pin per waiter: this ends
            more = self._round(groups_of(probed + freed))
            decisions += more
            probed = [d.lease._slot for d in more if type(d) is Granted and d.lease.probe]
            freed = self._budgets.take_unpinned()
        return decisions

    def with_unpinned(self, decisions: list[Decision]) -> list[Decision]:
        """``decisions`` and the grants the headroom of waiters that left unserved allows ([token-ledger])."""
        freed = self._budgets.take_unpinned()
        return decisions + self.dispatch(groups_of(freed)) if freed else decisions

    def settle_tokens(self, lease: Lease, used: int) -> list[Decision]:
        """:meth:`AdmissionState.settle_tokens <iop_admission.core.AdmissionState.settle_tokens>`."""
        slot = lease._slot
        ledger = slot.ledger
        if lease._released or ledger is None or ledger.settle(lease.id, used) <= 0:
            return []
        return self.dispatch(g for g, _ in slot.groups)

    def _round(self, groups: Iterable[ModelGroup]) -> list[Decision]:
        """Grant waiters of ``groups``, earliest first, while one has a dispatchable candidate.

        Within one group and kind, waiters share their candidates: if the head
        cannot run, nobody behind it can. So the next waiter to grant is the
        earliest head (over the groups and both kinds) whose group's index has
        a candidate for its kind, and it goes to that candidate. Queued retries
        of these groups (their own candidates) compete by arrival number too.
        """
        if self._tenants.tenancy is not None:
            return self._round_fair(tuple(groups), self._tenants.tenancy)
        queue = self._queue
        retries: list[Waiter] = []
        if queue.retries:
            groups = tuple(groups)
            retries = queue.retries_of(groups)
        groups = [g for g in groups if g.normal_live or g.long_live]
        decisions: list[Decision] = []
        while groups or retries:
            first: Waiter | None = None
            best: ProviderSlot | None = None
            for g in groups:
                for long in _KINDS:
                    if not (g.long_live if long else g.normal_live):
                        continue
                    if g.budgeted:  # a waiter that does not fit does not hold back a smaller one
                        found = g.first_fitting(long, first.seq if first is not None else None)
                        if found is not None:
                            first, best = found
                        continue
                    choice = g.best(long)  # asked first: after the last grant it is mostly None
                    if choice is not None:
                        w = g.head(long)
                        if w is not None and (first is None or w.seq < first.seq):
                            first, best = w, choice
            for w in retries:
                if first is not None and w.seq > first.seq:
                    break
                if w.state is QUEUED:
                    choice = best_of(w._candidates, w.long, w.tokens, w.seq)
                    if choice is not None:
                        first, best = w, choice
                        break
            if first is None or best is None:
                break
            queue.remove(first, GRANTED)
            w = first
            lease = self.grant(best, w.model, w.long, w.seq, w.enqueue_time, w.attempt, w.tried, w)
            first.lease = lease
            decisions.append(Granted(first, lease))
        return decisions

    def _round_fair(self, groups: tuple[ModelGroup, ...], tenancy: Tenancy) -> list[Decision]:
        """:meth:`_round` with tenants: the next grant is FairShare's among the dispatchable waiters.

        A waiter is dispatchable when its group (or, for a queued retry, its own
        candidates) has a candidate for its kind: the per-group test of
        :meth:`_round`. FairShare picks the band, then the tenant by
        virtual time, then the tenant's earliest dispatchable waiter.
        """
        decisions: list[Decision] = []
        if not self._any_dispatchable(groups):
            return decisions
        members = {id(g) for g in groups}
        names = {g.name for g in groups}

        def dispatchable(item: object) -> bool:
            w = cast(Waiter, item)
            g = w._group
            if g is not None:
                return id(g) in members and g.best(w.long, w.tokens, w.seq) is not None
            return w.model in names and best_of(w._candidates, w.long, w.tokens, w.seq) is not None

        grant = tenancy.fair.grant
        while True:
            ticket = grant(dispatchable)
            if ticket is None:
                break
            w = ticket.item
            assert isinstance(w, Waiter)
            if w._group is not None:
                best = w._group.best(w.long, w.tokens, w.seq)
            else:
                best = best_of(w._candidates, w.long, w.tokens, w.seq)
            assert best is not None
            self._queue.remove(w, GRANTED)
            w.lease = self.grant(best, w.model, w.long, w.seq, w.enqueue_time, w.attempt, w.tried, w)
            tenancy.note_grant(w.tenant)
            decisions.append(Granted(w, w.lease))
            if not self._any_dispatchable(groups):
                return decisions
        return decisions

    def _any_dispatchable(self, groups: tuple[ModelGroup, ...]) -> bool:
        """Whether a waiter of ``groups`` has a dispatchable candidate (its tenant's cap aside): O(groups)."""
        for g in groups:
            if g.budgeted:  # some waiter's tokens may fit: FairShare's scan tells
                if (g.normal_live and g.slot_free(False)) or (g.long_live and g.slot_free(True)):
                    return True
            elif (g.normal_live and g.best(False) is not None) or (g.long_live and g.best(True) is not None):
                return True
        if not self._queue.retries:
            return False
        return any(
            w.state is QUEUED and best_of(w._candidates, w.long, w.tokens, w.seq)
            for w in self._queue.retries_of(groups)
        )

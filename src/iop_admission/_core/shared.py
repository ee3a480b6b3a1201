"""The admission core's shared state and the steps every rule uses: grant, queue, dispatch.

:class:`StateCore` is the base of :class:`~iop_admission.core.AdmissionState`
(the one facade, ``_state.py``): it holds the providers, model groups and
queue, and grants waiters in order (``_dispatch``). The rules are split by
concern over its subclasses: health (``_health.py``), refresh
(``_refresh.py``), reading (``_queries.py``), requests and connectivity
(``_state.py``).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from typing import cast

from iop_admission._config import PoolConfig, ProviderKey, ProviderSpec, validate_pool
from iop_admission._errors import AdmissionError, QueueFull, TenantLimitExceeded, Unavailable
from iop_admission._fairness import TenantSpec

from .choice import best_of, could_run, groups_of
from .records import FAILED, GRANTED, QUEUED, Decision, Failed, Granted, Lease, Waiter, WaiterState
from .slots import PROBE, PROBING, ModelGroup, NodeState, ProviderSlot
from .tenancy import Tenancy


class StateCore:
    """Provider lease states, node generations and the global waiter queue (see AdmissionState)."""

    def __init__(self, config: PoolConfig) -> None:
        validate_pool(config)
        self._config = config
        self._nodes: dict[str, NodeState] = {}
        self._providers: dict[ProviderKey, ProviderSlot] = {}
        self._configured: tuple[ProviderSlot, ...] = ()
        self._groups: dict[str, ModelGroup] = {}
        self._waiters: dict[int, Waiter] = {}  # queued only, in arrival order
        self._seq = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self._max_queue = config.policy.max_queue
        self._timeout = config.policy.queue_timeout
        self._retries: list[Waiter] = []  # queued retries, in arrival order (also in _waiters)
        self._unhealthy: dict[ProviderKey, ProviderSlot] = {}  # ejected, probe due or probing
        self._now = 0.0  # the latest time passed in
        self._tenancy: Tenancy | None = None  # tenants configured: the fair order of grants
        self._pending: list[Decision] = []  # decisions of a request (waiters shed for it), not yet taken
        self._install(config)
        self._set_tenants(config.tenants)

    # ------------------------------------------------------------------ queries

    def _install(self, config: PoolConfig) -> None:
        self._configured = tuple(self._configure(key, spec) for key, spec in config.providers.items())
        for p in self._providers.values():
            p.groups = []
            p.counted = p.long_counted = p.admit_counted = p.long_admit_counted = False
        groups = {}
        for name, model in config.models.items():
            group = ModelGroup(name, tuple(self._providers[k] for k in model.candidates))
            for position, p in enumerate(group.providers):
                p.groups.append((group, position))
            groups[name] = group
        self._groups = groups
        for p in self._providers.values():
            p.update_eligibility()

    def _configure(self, key: ProviderKey, spec: ProviderSpec) -> ProviderSlot:
        """The provider ``key`` with ``spec``, configured: a new one, or the one kept (even retired)."""
        p = self._providers.get(key)
        if p is None:
            node = self._node(key.node_id)
            p = ProviderSlot(key, node, spec)
            self._providers[key] = p
            node.providers.append(p)
        else:
            p.set_spec(spec)
            p.configured = True
        return p

    def _build_group(self, name: str, candidates: tuple[ProviderKey, ...]) -> ModelGroup:
        """A model group new in a refresh, counted and indexed from its candidates' state now."""
        group = ModelGroup(name, tuple(map(self._providers.__getitem__, candidates)))
        for position, p in enumerate(group.providers):
            group.link(p, position)
        group.heapify()
        return group

    def _node(self, node_id: str) -> NodeState:
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = NodeState(node_id)
        return node

    def _drop_retired(self, p: ProviderSlot) -> None:
        del self._providers[p.key]
        p.node.providers.remove(p)
        self._unhealthy.pop(p.key, None)

    def _set_tenants(self, specs: tuple[TenantSpec, ...]) -> bool:
        """Put ``specs`` in force live (every lease and waiter kept); whether the order may have changed."""
        tenancy = self._tenancy
        if tenancy is not None and specs:
            return tenancy.configure(specs)
        if tenancy is None and specs:
            self._tenancy = Tenancy(specs)
            self._tenancy.requeue(self._waiters.values())
            return True
        if tenancy is not None:  # tenants gone: one global FIFO again
            self._tenancy = None
            for w in self._waiters.values():
                w._ticket = None
            for p in self._providers.values():
                for lease in p.leases.values():
                    lease._ticket = None
            return True
        return False

    def _shed_for(self, tenant: str, model: str) -> None:
        """The queue is full: evict the newest waiter of the lowest negative band below ``tenant``'s.

        Raises:
            TenantLimitExceeded: ``tenant`` is of a negative band and nothing lower waits (``"shed"``).
            QueueFull: nothing of a negative band below ``tenant``'s waits.
        """
        assert self._tenancy is not None
        fair = self._tenancy.fair
        priority = fair.spec(tenant).priority
        victim = fair.shed_victim(priority)
        if victim is None:
            if priority < 0:
                raise TenantLimitExceeded(tenant, "shed", self._max_queue)
            raise QueueFull(model, self._max_queue)
        w = victim.item
        assert isinstance(w, Waiter)
        self._remove(w, FAILED)
        w.error = TenantLimitExceeded(w.tenant, "shed", self._max_queue)
        self._pending.append(Failed(w, w.error))

    def _remove(self, waiter: Waiter, state: WaiterState) -> None:
        waiter.state = state
        if waiter._ticket is not None and self._tenancy is not None:
            self._tenancy.fair.cancel(waiter._ticket)
        del self._waiters[waiter.seq]
        if waiter._group is not None:
            waiter._group.forget(waiter)
        elif waiter.attempt > 1:
            self._retries.remove(waiter)

    def _enqueue_in_order(self, waiter: Waiter) -> None:
        """Add a retried waiter to the queue at its arrival place: O(queue), retries only."""
        waiters = self._waiters
        if not waiters or next(reversed(waiters)) < waiter.seq:
            waiters[waiter.seq] = waiter
            return
        items = list(waiters.items())
        items.insert(bisect.bisect_left(items, waiter.seq, key=lambda item: item[0]), (waiter.seq, waiter))
        self._waiters = dict(items)

    def _fail_unindexed(self, waiter: Waiter, error: AdmissionError) -> Failed:
        if waiter._ticket is not None and self._tenancy is not None:
            self._tenancy.fair.cancel(waiter._ticket)
        waiter.state = FAILED
        waiter.error = error
        del self._waiters[waiter.seq]
        return Failed(waiter, error)

    def _grant(
        self,
        p: ProviderSlot,
        model: str,
        long: bool,
        arrival: int,
        enqueue_time: float,
        attempt: int = 1,
        tried: tuple[ProviderKey, ...] = (),
        charge: Waiter | None = None,
    ) -> Lease:
        """A lease on ``p``; ``charge``: the waiter whose tenant, cost and ticket it carries."""
        lease = Lease(next(self._lease_ids), p, model, long, arrival, enqueue_time, attempt, tried)
        if charge is not None:
            lease.tenant, lease.cost, lease._ticket = charge.tenant, charge.cost, charge._ticket
        p.in_flight += 1
        if long:
            p.long_in_flight += 1
        p.leases[lease.id] = lease
        if p.health is PROBE:
            p.health = PROBING
            p.admitting = False
            p.probe_lease = lease.id
            p.probes += 1
            lease.probe = True
        p.reindex()
        return lease

    def _dispatch(self, groups: Iterable[ModelGroup]) -> list[Decision]:
        """Grant waiters of ``groups`` (:meth:`_dispatch_round`), then those of the groups of each
        provider a grant started probing: one that stops admitting may put them in panic mode."""
        decisions = self._dispatch_round(groups)
        probed = [d.lease._slot for d in decisions if type(d) is Granted and d.lease.probe]
        while probed:  # a provider starts one probe per ejection: this ends
            more = self._dispatch_round(groups_of(probed))
            decisions += more
            probed = [d.lease._slot for d in more if type(d) is Granted and d.lease.probe]
        return decisions

    def _probe_started(self, lease: Lease) -> None:
        """After an immediate grant: if it started a probe, grant whom it put in panic mode
        (decisions for :meth:`drain_decisions`)."""
        if lease.probe:
            self._pending += self._dispatch(g for g, _ in lease._slot.groups)

    def _dispatch_round(self, groups: Iterable[ModelGroup]) -> list[Decision]:
        """Grant waiters of ``groups``, earliest first, while one has a dispatchable candidate.

        Within one group and kind, waiters share their candidates: if the head
        cannot run, nobody behind it can. So the next waiter to grant is the
        earliest head (over the groups and both kinds) whose group's index has
        a candidate for its kind, and it goes to that candidate. Queued retries
        of these groups (their own candidates) compete by arrival number too.
        """
        if self._tenancy is not None:
            return self._dispatch_fair(tuple(groups), self._tenancy)
        groups = tuple(groups)
        retries = self._retries_of(groups) if self._retries else []
        groups = tuple(g for g in groups if g.normal_live or g.long_live)
        decisions: list[Decision] = []
        while groups or retries:
            first: Waiter | None = None
            best: ProviderSlot | None = None
            for g in groups:
                for long in (False, True):
                    w = g.head(long)
                    if w is not None and (first is None or w.seq < first.seq):
                        choice = g.best(long)
                        if choice is not None:
                            first, best = w, choice
            for w in retries:
                if first is not None and w.seq > first.seq:
                    break
                if w.state is QUEUED:
                    choice = best_of(w._candidates, w.long)
                    if choice is not None:
                        first, best = w, choice
                        break
            if first is None or best is None:
                break
            self._remove(first, GRANTED)
            w = first
            lease = self._grant(best, w.model, w.long, w.seq, w.enqueue_time, w.attempt, w.tried, w)
            first.lease = lease
            decisions.append(Granted(first, lease))
        return decisions

    def _dispatch_fair(self, groups: tuple[ModelGroup, ...], tenancy: Tenancy) -> list[Decision]:
        """:meth:`_dispatch` with tenants: the next grant is FairShare's among the dispatchable waiters.

        A waiter is dispatchable when its group (or, for a queued retry, its own
        candidates) has a candidate for its kind: the per-group test of
        :meth:`_dispatch`. FairShare picks the band, then the tenant by
        virtual time, then the tenant's earliest dispatchable waiter.
        """
        decisions: list[Decision] = []
        if not self._any_dispatchable(groups):
            return decisions
        members = {id(g) for g in groups}
        names = {g.name for g in groups}

        def dispatchable(item: object) -> bool:
            g = item._group  # type: ignore[attr-defined]
            if g is not None:
                return id(g) in members and g.best(item.long) is not None  # type: ignore[attr-defined]
            w = cast(Waiter, item)
            return w.model in names and best_of(w._candidates, w.long) is not None

        grant = tenancy.fair.grant
        while True:
            ticket = grant(dispatchable)
            if ticket is None:
                break
            w = ticket.item
            assert isinstance(w, Waiter)
            best = w._group.best(w.long) if w._group is not None else best_of(w._candidates, w.long)
            assert best is not None
            self._remove(w, GRANTED)
            w.lease = self._grant(best, w.model, w.long, w.seq, w.enqueue_time, w.attempt, w.tried, w)
            tenancy.note_grant(w.tenant)
            decisions.append(Granted(w, w.lease))
            if not self._any_dispatchable(groups):
                return decisions
        return decisions

    def _any_dispatchable(self, groups: tuple[ModelGroup, ...]) -> bool:
        """Whether a waiter of ``groups`` has a dispatchable candidate (its tenant's cap aside): O(groups)."""
        for g in groups:
            if (g.normal_live and g.best(False) is not None) or (g.long_live and g.best(True) is not None):
                return True
        if not self._retries:
            return False
        return any(w.state is QUEUED and best_of(w._candidates, w.long) for w in self._retries_of(groups))

    def _retries_of(self, groups: tuple[ModelGroup, ...]) -> list[Waiter]:
        names = {g.name for g in groups}
        return [w for w in self._retries if w.model in names]

    def _fail_stranded(self, groups: Iterable[ModelGroup]) -> list[Decision]:
        """Fail, with Unavailable, queued waiters of ``groups`` left with no eligible candidate."""
        stranded: list[Waiter] = []
        for g in groups:
            for long in (False, True):
                if not g.could_run(long):
                    stranded.extend(g.live(long))
        if self._retries:
            stranded.extend(w for w in self._retries_of(tuple(groups)) if not could_run(w._candidates, w.long))
        stranded.sort(key=lambda w: w.seq)
        decisions: list[Decision] = []
        for w in stranded:
            self._remove(w, FAILED)
            w.error = Unavailable(w.model, w.long)
            decisions.append(Failed(w, w.error))
        return decisions

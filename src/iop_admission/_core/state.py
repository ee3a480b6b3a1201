"""The sans-I/O admission core's one facade: :class:`AdmissionState`, the walk of a request through its parts.

Why the core is built this way, and what each part owns, is told in the
package docstring (``iop_admission/_core/__init__.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import final

from iop_admission._config import PoolConfig, ProviderKey, ProviderReport, validate_pool
from iop_admission._errors import (
    ModelNotFound,
    QueueFull,
    QueueTimeout,
    RetriesExhausted,
    TenantLimitExceeded,
    Unavailable,
)
from iop_admission._snapshot import StateReadings

from .budgets import Budgets
from .choice import GROUP, best_of, could_run, groups_of, reasons, untried
from .connectivity import Connectivity
from .dispatch import Dispatcher
from .health import Health
from .pool import Pool
from .queue import Queue
from .records import QUEUED, WITHDRAWN, Decision, Lease, Waiter
from .refresh import PreparedRefresh, Refresh
from .slots import ModelGroup
from .tenants import Tenants


@final
class AdmissionState(StateReadings):
    """Provider lease states, node generations and the global waiter queue.

    The calls here change the state and return the decisions that follow; the queries
    (``config``, ``waiters()``, ``provider_snapshots()``, ...) are :class:`StateReadings`'.

    Args:
        config: the pool configuration; validated as a whole.

    Raises:
        ConfigError: listing every problem of ``config``.
    """

    def __init__(self, config: PoolConfig) -> None:
        validate_pool(config)
        pool, tenants = Pool(), Tenants()
        self._budgets = budgets = Budgets(tenants)
        queue = Queue(config.policy, tenants, budgets)
        health = Health(config.outlier)
        self._dispatcher = dispatcher = Dispatcher(pool, queue, tenants, health, budgets)
        refresh = Refresh(config, pool, queue, health, tenants, dispatcher)
        super().__init__(pool, queue, tenants, health, refresh)
        self._connectivity = Connectivity(pool, queue, tenants, health, dispatcher)
        self._pending: list[Decision] = []  # decisions of a request (waiters shed for it), not yet taken
        pool.install(config)
        tenants.configure(config.tenants, (), ())

    # ---------------------------------------------------------------- requests

    def request(
        self,
        model: str,
        long: bool,
        now: float,
        tenant: str | None = None,
        cost: float = 1.0,
        tokens: int | None = None,
    ) -> Lease | Waiter:
        """Admit a request now, or queue it.

        ``tenant``: the configured tenant the request is charged to (a name not
        configured, or None, is the default tenant); ``cost``: its reserved
        cost, 1 per request or an estimate in tokens (:meth:`settle` replaces
        it with the usage); ``tokens``: its prompt plus ``max_tokens``, reserved on a provider
        with a token budget ([token-ledger]). With tenants configured the grant order is the
        tenants' fair share ([tenant-fair-share]); a request that finds the
        queue full may evict a waiter of a lower negative band, and a grant
        that starts a probe may grant waiters it put in panic mode: take those
        decisions with :meth:`drain_decisions`.

        Returns:
            A :class:`Lease` when a candidate is dispatchable now; otherwise the
            queued :class:`Waiter` (a later decision grants or fails it).

        Raises:
            ModelNotFound: ``model`` is not configured.
            Unavailable: no candidate is eligible, or has a budget ``tokens`` could fit (nothing is queued).
            QueueFull: ``max_queue`` waiters already exist.
            TenantLimitExceeded: the tenant's ``max_queue`` is reached, or the
                queue is full and the request is of a negative band with nothing lower to shed.
        """
        group = self._pool.groups.get(model)
        if group is None:
            raise ModelNotFound(model)
        if now > self._now:
            self._now = now
        if self._tenants.tenancy is not None:
            return self._request_fair(group, model, long, now, tenant, cost, tokens)
        queue = self._queue
        best = group.best(long, tokens)
        if best is not None:
            lease = self._dispatcher.grant(best, model, long, next(queue.arrivals), now, 1, (), None, tokens)
            lease.cost = cost
            if lease.probe:
                self._probe_started(lease)
            return lease
        group.check_take(model, long, tokens)
        if queue.full():
            raise QueueFull(model, queue.max_queue)
        waiter = Waiter(next(queue.arrivals), model, long, now, now + queue.timeout, 1, (), tokens)
        waiter.cost = cost
        queue.add(waiter, group)
        return waiter

    def _request_fair(
        self, group: ModelGroup, model: str, long: bool, now: float, tenant: str | None, cost: float, tokens: int | None
    ) -> Lease | Waiter:
        """:meth:`request` with tenants: quotas, shedding, then today's rule under FairShare's order."""
        tenants, queue = self._tenants, self._queue
        assert tenants.tenancy is not None
        fair = tenants.tenancy.fair
        name = fair.tenant_of(tenant)
        best = group.best(long, tokens)
        if best is not None and fair.can_run(name):
            lease = self._dispatcher.grant(best, model, long, next(queue.arrivals), now, tokens=tokens)
            tenants.charge(lease, name, cost)
            self._probe_started(lease)
            return lease
        group.check_take(model, long, tokens)
        fair.check_queue(name)
        if queue.full():
            victim = tenants.shed_victim(name, model, queue.max_queue)
            self._pending.append(queue.fail(victim, TenantLimitExceeded(victim.tenant, "shed", queue.max_queue)))
        waiter = Waiter(next(queue.arrivals), model, long, now, now + queue.timeout, tokens=tokens)
        tenants.ticket_waiter(waiter, name, cost)
        queue.add(waiter, group)
        return waiter

    def retry(self, lease: Lease, now: float) -> Lease | Waiter:
        """Ask again for the request ``lease`` served, on a candidate not tried yet.

        The retry keeps the request's arrival number and queue deadline
        (``enqueue_time + queue_timeout``): granted at once when a candidate is
        dispatchable, otherwise queued at its old place in arrival order. A
        retry is never refused for a full queue (the request was admitted once
        already). Each lease can be retried once.

        Returns:
            A :class:`Lease` (``attempt`` one more) or the queued :class:`Waiter`.

        Raises:
            RetriesExhausted: ``lease.attempt`` is ``retry.max_attempts`` already.
            ModelNotFound: the model is no longer configured.
            QueueTimeout: the request's queue deadline is past.
            Unavailable: no candidate left that was not tried is eligible.
            RuntimeError: the lease was retried before.
        """
        if lease._retried:
            raise RuntimeError(f"{lease!r} was retried already")
        model, long = lease.model, lease.long
        if lease.attempt >= self._refresh.config.retry.max_attempts:
            raise RetriesExhausted(model, lease.attempt)
        group = self._pool.groups.get(model)
        if group is None:
            raise ModelNotFound(model)
        self._now = max(self._now, now)
        deadline = lease.enqueue_time + self._queue.timeout
        if deadline <= now:
            raise QueueTimeout(model, now - lease.enqueue_time)
        candidates, tokens = untried(group.providers, lease.tried), lease.tokens
        best = best_of(candidates, long, tokens)
        if best is None and not could_run(candidates, long, tokens):
            raise Unavailable(model, long, reasons(group.providers, long, lease.tried, tokens))
        lease._retried = True
        attempt = lease.attempt + 1
        # A retry is an attempt of its own, charged as one: the request's tenant and reserve.
        tenant, cost = lease.tenant, lease.cost
        if best is not None and self._tenants.can_run(tenant):
            again = self._dispatcher.grant(
                best, model, long, lease.arrival, lease.enqueue_time, attempt, lease.tried, None, tokens
            )
            self._tenants.charge(again, tenant, cost)
            self._probe_started(again)
            return again
        waiter = Waiter(lease.arrival, model, long, lease.enqueue_time, deadline, attempt, lease.tried, tokens)
        waiter._candidates = candidates
        self._tenants.ticket_waiter(waiter, tenant, cost)
        self._queue.add_retry(waiter)
        return waiter

    def _probe_started(self, lease: Lease) -> None:
        """After an immediate grant: if it started a probe, grant whom it put in panic mode
        (decisions for :meth:`drain_decisions`)."""
        if lease.probe:
            self._pending += self._dispatcher.probe_started(lease)

    def drain_decisions(self) -> list[Decision]:
        """Decisions made by the last :meth:`request`, :meth:`retry`, :meth:`withdraw` or :meth:`expire`.

        A request that finds the queue full evicts the newest waiter of a lower negative band ([tenant-quotas]);
        a grant that starts a provider's probe stops it admitting, which may put the waiters of its model
        groups in panic mode, and they are granted ([outlier-ejection]); a waiter that leaves gives back the
        tokens held for it ([token-ledger]). Carry these out. The list returned is not to be changed.
        """
        out = self._pending
        if out:
            self._pending = []
        return self._dispatcher.with_unpinned(out) if self._budgets.unpinned else out

    def withdraw(self, waiter: Waiter) -> bool:
        """Remove a queued waiter (its task was cancelled or its deadline passed).

        Returns:
            False if the waiter was no longer queued (already granted or failed).
        """
        if waiter.state is not QUEUED:
            return False
        self._queue.remove(waiter, WITHDRAWN)
        return True

    def expire(self, now: float) -> list[Waiter]:
        """Remove every waiter whose deadline is ``<= now``; return them, oldest first.

        The cost is the number of waiters expired, not the length of the queue
        (deadlines grow along the queue: see :meth:`Queue.expire <.queue.Queue.expire>`).
        """
        return self._queue.expire(now)

    def release(self, lease: Lease) -> list[Decision]:
        """Release a lease (idempotent) and hand freed capacity to waiters.

        Call it when the lease's body has exited, revoked or not: a revoked
        lease's capacity stays counted (``revoked_in_flight``) until then.

        Returns:
            The grants this release caused; empty if the lease was already
            released (for example by fencing).
        """
        if lease._released:
            return []
        lease._released = True
        slot = lease._slot
        self._pool.give_back(lease)
        reopened = wake_all = False
        if not lease._revoked:  # (a revoked lease's tenant slot was freed by fencing)
            if lease.probe and slot.probe_lease == lease.id:
                self._health.reopen_probe(slot)
                reopened = True
            # A tenant back under its max_in_flight may have waiters in any group.
            wake_all = lease._ticket is not None and self._tenants.release_ticket(lease)
        dispatch = self._dispatcher.dispatch
        if not slot.configured and not slot.busy:
            self._pool.drop(slot)
            return dispatch(self._pool.groups.values()) if wake_all else []
        if reopened or slot.indexed:  # else only its load changed, which its groups of one read themselves
            slot.reindex()
        if wake_all:
            return dispatch(self._pool.groups.values())
        if self._queue.retries:
            return dispatch(map(GROUP, slot.groups))
        for g, _ in slot.groups:
            if g.normal_live or g.long_live:
                return dispatch(map(GROUP, slot.groups))
        return []

    def settle(self, lease: Lease, actual: float) -> None:
        """Replace the cost reserved for ``lease`` with the cost it used ([tenant-token-cost]).

        Call once the run ended, with the usage the backend reported (tokens,
        or 1 for a request): the tenant's virtual time and charged total follow
        the cost used, not the estimate. Without tenants it only records it.
        """
        self._tenants.settle(lease, actual)

    def settle_tokens(self, lease: Lease, used: int) -> list[Decision]:
        """Set ``lease``'s reservation to the ``used`` tokens ([token-ledger]); the grants that allows."""
        return self._dispatcher.settle_tokens(lease, used)

    def hold(self, provider: ProviderKey, runs: int, long_runs: int = 0) -> list[Decision]:
        """Count ``runs`` held elsewhere against ``provider``'s capacity, ``long_runs`` of them
        against its long-context slots too, until changed [held-elsewhere].

        Runs this state did not grant but that use the provider all the same
        -- the runs another Edge left running on a node (docs/ha.md) -- count
        in its ``in_flight`` (and the long ones in its ``long_in_flight``) like
        live leases: no grant takes the provider past its capacity or its long
        slots with them. The counts replace the provider's previous ones (0
        ends them); they belong to the node's current connection:
        :meth:`disconnect` and :meth:`connect` drop them. A provider not
        configured, or whose node is not connected, is left as it is.

        Returns:
            The grants a lower count caused (empty when neither went down).

        Raises:
            ValueError: ``runs`` is negative, or ``long_runs`` is negative or more than ``runs``.
        """
        if runs < 0 or not 0 <= long_runs <= runs:
            raise ValueError(f"runs held must be >= 0 and long runs between 0 and them, got {runs} and {long_runs}")
        freed = self._pool.hold(provider, runs, long_runs)
        return self._dispatcher.dispatch(g for g, _ in freed.groups) if freed is not None else []

    # ------------------------------------------------------------ connectivity

    def connect(self, node_id: str) -> tuple[int, list[Decision]]:
        """Start a new generation of ``node_id``; its providers come online.

        If the node was connected, its old generation is fenced first, as by
        :meth:`disconnect`.

        Returns:
            The new generation and the decisions (revocations, then grants).
        """
        return self._connectivity.connect(node_id)

    def disconnect(self, node_id: str, generation: int) -> tuple[bool, list[Decision]]:
        """Take a node offline if ``generation`` is its current, connected one.

        Fences the generation (every live lease on the node's providers is
        revoked: no longer live, its capacity counted as revoked and still
        running until its holder releases it), then fails each waiter left with
        no eligible candidate with :class:`Unavailable`.

        Returns:
            ``(False, [])`` for a stale generation or a node not connected;
            otherwise ``(True, decisions)``.
        """
        return self._connectivity.disconnect(node_id, generation)

    # ------------------------------------------------------------------ health

    def report_failure(self, lease: Lease, now: float) -> list[Decision]:
        """Count a provider failure of ``lease`` (once per lease; stale reports change nothing).

        On a healthy provider the ``outlier.consecutive_failures``-th failure in a
        row ejects it (0: never); on an ejected one only its probe's failure
        counts: it ejects the provider again, for twice as long (capped).

        Returns:
            ``Ejected`` and the grants it causes (waiters entering panic mode).
        """
        self._now = max(self._now, now)
        p = self._health.reportable(lease, self._pool.providers)
        if p is None or not self._health.failure(p, lease):
            return []
        return [self._health.eject(p, now), *self._dispatcher.dispatch(g for g, _ in p.groups)]

    def report_success(self, lease: Lease, now: float) -> list[Decision]:
        """Count a success of ``lease`` (once per lease; stale reports change nothing).

        A success resets the failure count; on an ejected provider (its probe,
        or a lease granted in panic mode during the ejection) it restores it.

        Returns:
            ``Restored`` and the grants it causes; empty for a healthy provider.
        """
        self._now = max(self._now, now)
        p = self._health.reportable(lease, self._pool.providers)
        if p is None or not self._health.success(p):
            return []
        return [self._health.restore(p), *self._dispatcher.dispatch(g for g, _ in p.groups)]

    def advance(self, now: float) -> list[Decision]:
        """End every ejection whose time is ``<= now``: its probe may be granted now.

        Returns:
            The grants this causes (the probe goes to the earliest waiter that can use it).
        """
        self._now = max(self._now, now)
        due = self._health.end_due(now)
        return self._dispatcher.dispatch(groups_of(due)) if due else []

    def report_health(self, provider: ProviderKey, report: ProviderReport, now: float) -> list[Decision]:
        """A node's report of ``provider`` ([health-probe]): ``Ejected``/``Restored`` if any, then the grants."""
        self._now = max(self._now, now)
        decisions = self._health.report(p := self._pool.providers.get(provider), report, now)
        return [] if decisions is None or p is None else decisions + self._dispatcher.dispatch(g for g, _ in p.groups)

    # ----------------------------------------------------------------- refresh

    def prepare_refresh(self, config: PoolConfig, pause: Callable[[], None] | None = None) -> PreparedRefresh:
        """:func:`prepare_refresh` against the configuration in force now (reads nothing else).

        Safe in a worker thread while this state changes on another.

        Raises:
            ConfigError: listing every problem of ``config``.
        """
        return self._refresh.prepare(config, pause)

    def refresh(self, config: PoolConfig | PreparedRefresh) -> list[Decision]:
        """Apply a new configuration atomically; leases are kept.

        Validates first (on error nothing changes). Then: provider specs are
        replaced (a provider dropped from the config keeps its live leases
        until they end, but takes no new work); model groups are replaced;
        every queued waiter gets its model's new candidates and the deadline
        ``enqueue_time + new queue_timeout``; a waiter whose model is gone
        fails with :class:`ModelNotFound`, one with no eligible candidate left
        with :class:`Unavailable`; finally waiters are re-evaluated in arrival
        order against every provider.

        A :class:`PreparedRefresh` applies its configuration with exactly the
        same outcome. Prepared against the configuration in force, only what
        it changes is touched: the providers whose spec changed (or that were
        added or removed) and the model groups whose candidates changed; the
        other groups keep their index and their waiters' places (O(changes +
        queued waiters)). Otherwise the whole configuration is installed.

        Raises:
            ConfigError: listing every problem; the state is unchanged.
        """
        return self._refresh.apply(config)

    def __repr__(self) -> str:
        return f"<AdmissionState {self._pool.load()} with {len(self._queue.waiters)} waiting>"

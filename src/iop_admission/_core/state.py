"""The sans-I/O admission core: the only code that changes admission state.

Like h11's connection object, this module does no I/O, has no clock of its own
(time is passed in as ``now``) and does not import trio. Every method is
synchronous and returns *decisions* -- :class:`Granted`, :class:`Failed`,
:class:`Revoked` -- that the trio layer (``_admission.py``) carries out by
waking parked tasks or cancelling lease bodies. The Hypothesis state machine
drives this class directly.

Why it is built this way:

* **One state per provider.** A :class:`ProviderSlot` holds capacity and the
  in-flight counters for every model group that lists it ([provider-state],
  [long-state]). Model groups hold only references to provider states.

* **Hand-off, decided synchronously.** Whenever capacity may have appeared
  (release, fence, connect, refresh) the core grants waiters right away, before
  returning. A granted waiter owns its lease from that instant even though its
  task has not run yet, exactly like ``trio.CapacityLimiter``. Hence *work
  conservation* holds after every method: no queued waiter has a dispatchable
  candidate. A newcomer is therefore granted only a provider no earlier waiter
  could use -- it never overtakes.

* **Global arrival order without scanning.** Each model group keeps its
  waiters, normal and long separately, in arrival order. Arrival numbers only
  grow, so each is a FIFO deque with lazy deletion; a waiter that leaves
  (granted, cancelled, failed) is skipped when it reaches the front, and a
  deque is compacted when its dead entries outnumber its live ones. Waiters of
  one group share their candidates, so when a head cannot run, nobody behind
  it can. After a release on provider P the next waiter is the earliest head,
  over the groups listing P, that has a dispatchable candidate (the long head
  only when a long slot is free): one release costs O(groups of P),
  independent of queue length. A long waiter blocked on long slots is simply
  not looked at: the normal waiter behind it runs (no head-of-line blocking)
  [cross-group-wakeup].

* **Candidate choice is indexed** [candidate-choice-scale]. The rule --
  highest priority, then lowest ``in_flight / capacity``, then candidate
  order -- is kept per model group as a heap of dispatchable candidates with
  lazy deletion (see :class:`ModelGroup`); a change of a provider's load,
  eligibility or spec re-enters it in every group listing it, O(log n) each
  (:meth:`ProviderSlot.reindex`). Choosing costs the same with one candidate or
  ten thousand. Whoever changes what makes a provider eligible or loaded must
  call ``reindex`` afterwards.

* **Passive health** [outlier-ejection]. Every lease can carry one report,
  failure or success. ``outlier.consecutive_failures`` failures in a row
  eject the provider until a time (``base_ejection`` doubled per ejection in a
  row, capped at ``max_ejection``); :meth:`AdmissionState.advance` ends it, and
  then exactly one *probe* grant may run; its success restores the provider,
  its failure ejects it again for longer. A provider that is ejected or has
  its probe out is not *admitting*: it leaves its groups' choice heaps like a
  full provider (``reindex`` reads ``admitting``). Eligibility (config,
  enabled, connected) is unchanged, so an ejected provider never makes a
  waiter ``Unavailable``. Panic mode: a group whose every eligible candidate is
  non-admitting chooses among them anyway (a scan of its candidates, paid only
  in panic), so ejection never turns a model key with a single bad provider
  into one that admits nothing. A report is *stale* -- and changes nothing --
  when its lease was already reported, its node generation is over, or the
  provider changed health epoch (ejected or restored) since the grant:
  failures of leases granted before an ejection do not lengthen it.

* **Retry keeps the arrival place** [failover-before-first-byte]. Every
  request draws its arrival number when it asks, granted at once or queued.
  :meth:`AdmissionState.retry` asks again for the same request on a candidate
  it has not tried, with that old number and its old queue deadline. A queued
  retry does not share its group's candidates (it excludes the tried ones), so
  it waits in a short list of its own, in arrival order, which ``_dispatch``
  looks at beside the group heads: no later arrival that could use the same
  provider overtakes it. Retries are few (one per failed attempt), and each
  costs a scan of its candidates.

* **Runs held elsewhere** [held-elsewhere]. :meth:`AdmissionState.hold` sets
  a count of runs on a provider that this state did not grant (another
  Edge's, docs/ha.md), and how many of them are long; they are added to
  ``in_flight`` and ``long_in_flight``, so every capacity and long-slot check
  and the choice rule see them, and a lower count hands the room to waiters.

* **Generations fence.** ``connect`` starts a new generation of a node;
  ``disconnect`` with the current generation takes the node offline and
  revokes every live lease on its providers: the lease is no longer live
  (``in_flight`` of the fenced generation reads 0 at once, its tenant's slot
  is free), its body is told to stop (:class:`Revoked`), and each lease is
  still released exactly once, by its holder.

* **Capacity held until the body has left** [revoked-in-flight]. A revoked
  lease's body may still be running (trio runs it to its next checkpoint; an
  asyncio body may catch the cancellation), so its provider capacity (and
  long slot) comes back only when the holder releases it, at the body's exit.
  Until then it is *revoked, still running*: counted apart from ``in_flight``
  (``revoked_in_flight``, ``revoked_long_in_flight`` of the snapshot) and,
  with it, against capacity in every check and in the choice rule. So running
  bodies never exceed a provider's capacity, whatever a fenced body does.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from typing import final

from iop_admission._config import ProviderKey
from iop_admission._errors import ModelNotFound, QueueFull, QueueTimeout, RetriesExhausted, Unavailable

from .choice import best_of, by_seq, could_run, groups_of, reasons, untried
from .prepared import PreparedRefresh, prepare_refresh
from .queries import StateQueries
from .records import (
    FAILED,
    GRANTED,
    QUEUED,
    TIMED_OUT,
    WITHDRAWN,
    Decision,
    Ejected,
    Failed,
    Granted,
    Lease,
    Restored,
    Revoked,
    Waiter,
    WaiterState,
)
from .refresh import RefreshRules
from .slots import NodeState
from .tenant_rules import TenantRules

__all__ = [
    "FAILED",
    "GRANTED",
    "QUEUED",
    "TIMED_OUT",
    "WITHDRAWN",
    "AdmissionState",
    "Decision",
    "Ejected",
    "Failed",
    "Granted",
    "Lease",
    "PreparedRefresh",
    "Restored",
    "Revoked",
    "Waiter",
    "WaiterState",
    "prepare_refresh",
]


@final
class AdmissionState(RefreshRules, StateQueries, TenantRules):
    """Provider lease states, node generations and the global waiter queue.

    Args:
        config: the pool configuration; validated as a whole.

    Raises:
        ConfigError: listing every problem of ``config``.
    """

    def request(
        self, model: str, long: bool, now: float, tenant: str | None = None, cost: float = 1.0
    ) -> Lease | Waiter:
        """Admit a request now, or queue it.

        ``tenant``: the configured tenant the request is charged to (a name not
        configured, or None, is the default tenant); ``cost``: its reserved
        cost, 1 per request or an estimate in tokens (:meth:`settle` replaces
        it with the usage). With tenants configured the grant order is the
        tenants' fair share ([tenant-fair-share]); a request that finds the
        queue full may evict a waiter of a lower negative band, and a grant
        that starts a probe may grant waiters it put in panic mode: take those
        decisions with :meth:`drain_decisions`.

        Returns:
            A :class:`Lease` when a candidate is dispatchable now; otherwise the
            queued :class:`Waiter` (a later decision grants or fails it).

        Raises:
            ModelNotFound: ``model`` is not configured.
            Unavailable: no candidate is eligible (nothing is queued).
            QueueFull: ``max_queue`` waiters already exist.
            TenantLimitExceeded: the tenant's ``max_queue`` is reached, or the
                queue is full and the request is of a negative band with nothing lower to shed.
        """
        group = self._groups.get(model)
        if group is None:
            raise ModelNotFound(model)
        if now > self._now:
            self._now = now
        if self._tenancy is not None:
            return self._request_fair(group, model, long, now, tenant, cost)
        best = group.best(long)
        if best is not None:
            lease = self._grant(best, model, long, next(self._seq), now)
            lease.cost = cost
            self._probe_started(lease)
            return lease
        if not group.could_run(long):
            raise Unavailable(model, long, reasons(group.providers, long, ()))
        if len(self._waiters) >= self._max_queue:
            raise QueueFull(model, self._max_queue)
        waiter = Waiter(next(self._seq), model, long, now, now + self._timeout)
        waiter.cost = cost
        waiter._candidates = group.providers
        group.enqueue(waiter)
        self._waiters[waiter.seq] = waiter
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
        if lease.attempt >= self._config.retry.max_attempts:
            raise RetriesExhausted(model, lease.attempt)
        group = self._groups.get(model)
        if group is None:
            raise ModelNotFound(model)
        self._now = max(self._now, now)
        deadline = lease.enqueue_time + self._timeout
        if deadline <= now:
            raise QueueTimeout(model, now - lease.enqueue_time)
        candidates = untried(group.providers, lease.tried)
        best = best_of(candidates, long)
        if best is None and not could_run(candidates, long):
            raise Unavailable(model, long, reasons(group.providers, long, lease.tried))
        lease._retried = True
        attempt = lease.attempt + 1
        tenant, cost = self._carry_cost(lease)
        if best is not None and self._can_run(tenant):
            again = self._grant(best, model, long, lease.arrival, lease.enqueue_time, attempt, lease.tried)
            self._charge(again, tenant, cost)
            self._probe_started(again)
            return again
        waiter = Waiter(lease.arrival, model, long, lease.enqueue_time, deadline, attempt, lease.tried)
        waiter._candidates = candidates
        self._ticket_waiter(waiter, tenant, cost)
        bisect.insort(self._retries, waiter, key=by_seq)
        self._enqueue_in_order(waiter)
        return waiter

    def withdraw(self, waiter: Waiter) -> bool:
        """Remove a queued waiter (its task was cancelled or its deadline passed).

        Returns:
            False if the waiter was no longer queued (already granted or failed).
        """
        if waiter.state is not QUEUED:
            return False
        self._remove(waiter, WITHDRAWN)
        return True

    def expire(self, now: float) -> list[Waiter]:
        """Remove every waiter whose deadline is ``<= now``; return them, oldest first.

        Deadlines are ``enqueue_time + queue_timeout`` with one timeout for all
        waiters, and the queue is in arrival order (a retry goes back to its
        arrival place with its original enqueue time), so deadlines grow along
        the queue and the scan stops at the first waiter still in time: the cost
        is the number of waiters expired, not the length of the queue (this is
        the path every firing queue deadline takes).
        """
        out = list(itertools.takewhile(lambda waiter: waiter.deadline <= now, self._waiters.values()))
        for waiter in out:
            self._remove(waiter, TIMED_OUT)
        return out

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
        slot.in_flight -= 1
        if lease.long:
            slot.long_in_flight -= 1
        if lease._revoked:  # its body has left: the capacity fencing kept counted comes back
            del slot.revoked[lease.id]
            slot.revoked_long -= lease.long
            wake_all = False  # fencing freed its tenant's slot already
        else:
            del slot.leases[lease.id]
            if lease.probe and slot.probe_lease == lease.id:
                self._reopen_probe(slot)
            # A tenant back under its max_in_flight may have waiters in any group.
            wake_all = lease._ticket is not None and self._release_ticket(lease)
        if not slot.configured and not slot.busy:
            self._drop_retired(slot)
            return self._dispatch(self._groups.values()) if wake_all else []
        slot.reindex()
        if wake_all:
            return self._dispatch(self._groups.values())
        if self._retries:
            return self._dispatch(g for g, _ in slot.groups)
        for g, _ in slot.groups:
            if g.normal_live or g.long_live:
                return self._dispatch(g for g, _ in slot.groups)
        return []

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
        slot = self._providers.get(provider)
        if slot is None or not slot.configured or not slot.node.connected:
            return []
        step, long_step = runs - slot.held, long_runs - slot.held_long
        if not step and not long_step:
            return []
        slot.held, slot.held_long = runs, long_runs
        slot.in_flight += step
        slot.long_in_flight += long_step
        slot.reindex()
        return self._dispatch(g for g, _ in slot.groups) if step < 0 or long_step < 0 else []

    # ------------------------------------------------------------ connectivity

    def connect(self, node_id: str) -> tuple[int, list[Decision]]:
        """Start a new generation of ``node_id``; its providers come online.

        If the node was connected, its old generation is fenced first, as by
        :meth:`disconnect`.

        Returns:
            The new generation and the decisions (revocations, then grants).
        """
        node = self._node(node_id)
        decisions: list[Decision] = []
        if node.connected:
            decisions.extend(self._fence(node))
        node.generation += 1
        node.connected = True
        for p in node.providers:
            p.update_eligibility()
        # Fenced leases freed their tenants' slots: with tenants, any group may run now.
        decisions.extend(self._dispatch(self._groups.values() if self._tenancy else groups_of(node.providers)))
        return node.generation, decisions

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
        node = self._nodes.get(node_id)
        if node is None or not node.connected or node.generation != generation:
            return False, []
        node.connected = False
        decisions: list[Decision] = list(self._fence(node))
        for p in node.providers:
            p.update_eligibility()
        groups = groups_of(node.providers)
        decisions.extend(self._fail_stranded(groups))
        if self._tenancy is not None:  # fenced leases freed their tenants' slots
            decisions.extend(self._dispatch(self._groups.values()))
        elif self._unhealthy:  # groups left with only ejected candidates enter panic mode
            decisions.extend(self._dispatch(groups))
        return True, decisions

    def _fence(self, node: NodeState) -> Iterator[Revoked]:
        """Revoke every live lease of ``node``'s providers and drop their runs held elsewhere.

        A revoked lease keeps counting in ``in_flight`` (as revoked, still
        running) until its holder releases it [revoked-in-flight].
        """
        for p in tuple(node.providers):
            if not p.leases and not p.held:
                continue
            for lease in tuple(p.leases.values()):
                lease._revoked = True
                self._release_ticket(lease)
                if lease.probe and p.probe_lease == lease.id:
                    self._reopen_probe(p)
                p.revoked[lease.id] = lease
                p.revoked_long += lease.long
                yield Revoked(lease)
            p.leases.clear()
            p.forget_held()
            if not p.configured and not p.revoked:
                self._drop_retired(p)
            else:
                p.reindex()

    def __repr__(self) -> str:
        revoked = sum(len(p.revoked) for p in self._providers.values())
        busy = sum(p.in_flight - len(p.revoked) for p in self._configured)
        cap = sum(p.capacity for p in self._configured if p.eligible)
        running = f" ({revoked} revoked still running)" if revoked else ""
        return f"<AdmissionState {busy}/{cap} in flight{running} with {len(self._waiters)} waiting>"

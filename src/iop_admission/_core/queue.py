"""The waiting part of the admission core: the global queue in arrival order, queued retries, deadlines."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping

from iop_admission._config import ProviderKey, QueuePolicy
from iop_admission._errors import AdmissionError, ModelNotFound, Unavailable

from .budgets import Budgets
from .choice import by_seq, could_run, untried
from .records import FAILED, GRANTED, TIMED_OUT, Decision, Failed, Waiter, WaiterState
from .slots import ModelGroup
from .tenants import Tenants


class Queue:
    """Every queued waiter, in arrival order, and the queued retries among them.

    A first attempt waits in its model group's deques too (the group's index
    serves it); a queued retry has its own candidates and waits in
    :attr:`retries`, which dispatch looks at beside the group heads.
    """

    __slots__ = ("waiters", "retries", "max_queue", "timeout", "arrivals", "_tenants", "_budgets")

    def __init__(self, policy: QueuePolicy, tenants: Tenants, budgets: Budgets) -> None:
        self.waiters: dict[int, Waiter] = {}  # queued only, in arrival order
        self.retries: list[Waiter] = []  # queued retries, in arrival order (also in waiters)
        self.arrivals = itertools.count(1)  # arrival numbers: every request draws one when it asks
        self._tenants = tenants
        self._budgets = budgets
        self.max_queue = policy.max_queue
        self.timeout = policy.queue_timeout

    def set_policy(self, policy: QueuePolicy) -> None:
        self.max_queue = policy.max_queue
        self.timeout = policy.queue_timeout

    def full(self) -> bool:
        return len(self.waiters) >= self.max_queue

    def add(self, waiter: Waiter, group: ModelGroup) -> None:
        """Queue a first attempt, the newest arrival, behind its group's waiters."""
        waiter._candidates = group.providers
        group.enqueue(waiter)
        self.waiters[waiter.seq] = waiter

    def add_retry(self, waiter: Waiter) -> None:
        """Queue a retry at its arrival place: O(queue), retries only."""
        bisect.insort(self.retries, waiter, key=by_seq)
        waiters = self.waiters
        if not waiters or next(reversed(waiters)) < waiter.seq:
            waiters[waiter.seq] = waiter
            return
        items = list(waiters.items())
        items.insert(bisect.bisect_left(items, waiter.seq, key=lambda item: item[0]), (waiter.seq, waiter))
        self.waiters = dict(items)

    def remove(self, waiter: Waiter, state: WaiterState) -> None:
        waiter.state = state
        if waiter._ticket is not None:
            self._tenants.cancel(waiter)
        del self.waiters[waiter.seq]
        if waiter._group is not None:
            waiter._group.forget(waiter)
        elif waiter.attempt > 1:
            self.retries.remove(waiter)
        if waiter._passed is not None and state is not GRANTED:  # granted: forgotten once it reserved
            self._budgets.forget(waiter)

    def fail(self, waiter: Waiter, error: AdmissionError) -> Failed:
        """Remove ``waiter`` for good with ``error``."""
        self.remove(waiter, FAILED)
        waiter.error = error
        return Failed(waiter, error)

    def expire(self, now: float) -> list[Waiter]:
        """Remove every waiter whose deadline is ``<= now``; return them, oldest first.

        Deadlines are ``enqueue_time + queue_timeout`` with one timeout for all
        waiters, and the queue is in arrival order (a retry goes back to its
        arrival place with its original enqueue time), so deadlines grow along
        the queue and the scan stops at the first waiter still in time: the cost
        is the number of waiters expired, not the length of the queue.
        """
        out = list(itertools.takewhile(lambda waiter: waiter.deadline <= now, self.waiters.values()))
        for waiter in out:
            self.remove(waiter, TIMED_OUT)
        return out

    def retries_of(self, groups: tuple[ModelGroup, ...]) -> list[Waiter]:
        names = {g.name for g in groups}
        return [w for w in self.retries if w.model in names]

    def retry_pressure(self) -> dict[ProviderKey, tuple[int, int]]:
        """Candidate pressure of queued retries: (waiters, of which long) per provider."""
        out: dict[ProviderKey, tuple[int, int]] = {}
        for w in self.retries:
            for p in w._candidates:
                if p.eligible and (not w.long or p.long_capacity >= 1):
                    n, n_long = out.get(p.key, (0, 0))
                    out[p.key] = (n + 1, n_long + w.long)
        return out

    def fail_stranded(self, groups: Iterable[ModelGroup]) -> list[Decision]:
        """Fail, with Unavailable, queued waiters of ``groups`` left with no eligible candidate."""
        stranded: list[Waiter] = []
        groups = tuple(groups)
        for g in groups:
            for long in (False, True):
                if not g.could_run(long):
                    stranded.extend(g.live(long))
                elif g.budgeted:  # a lower budget may leave a request no candidate it fits
                    stranded.extend(w for w in g.live(long) if not could_run(g.providers, long, w.tokens))
        if self.retries:
            stranded.extend(w for w in self.retries_of(groups) if not could_run(w._candidates, w.long, w.tokens))
        stranded.sort(key=lambda w: w.seq)
        return [self.fail(w, Unavailable(w.model, w.long)) for w in stranded]

    def requeue(self, groups: Mapping[str, ModelGroup]) -> list[Decision]:
        """After a refresh: each queued waiter's new deadline, candidates and place, in arrival order.

        A waiter of a model key that is gone fails with ModelNotFound, one whose
        candidates can no longer run it with Unavailable. A waiter whose group
        was kept stays where it is; the others join their new group's queue.
        """
        decisions: list[Decision] = []
        retries: list[Waiter] = []
        for w in tuple(self.waiters.values()):
            group = groups.get(w.model)
            if group is None:
                w._group = None
                decisions.append(self._fail_unindexed(w, ModelNotFound(w.model)))
                continue
            w.deadline = w.enqueue_time + self.timeout
            if w.attempt > 1:  # a queued retry: its own candidates, its own list
                w._candidates = untried(group.providers, w.tried)
                if could_run(w._candidates, w.long, w.tokens):
                    retries.append(w)
                else:
                    decisions.append(self._fail_unindexed(w, Unavailable(w.model, w.long)))
                continue
            if w._group is group:  # a kept group: the waiter keeps its place
                if not group.could_take(w.long, w.tokens):
                    decisions.append(self.fail(w, Unavailable(w.model, w.long)))
                continue
            w._group = None
            w._candidates = group.providers
            if w._passed is not None:  # no headroom held where it can no longer run
                self._budgets.moved(w, group.providers)
            if group.could_take(w.long, w.tokens):
                group.enqueue(w)
            else:
                decisions.append(self._fail_unindexed(w, Unavailable(w.model, w.long)))
        self.retries = retries
        return decisions

    def _fail_unindexed(self, waiter: Waiter, error: AdmissionError) -> Failed:
        """Fail a waiter that is in no group's deque nor (any longer) in :attr:`retries`."""
        self._tenants.cancel(waiter)
        waiter.state = FAILED
        waiter.error = error
        del self.waiters[waiter.seq]
        if waiter._passed is not None:
            self._budgets.forget(waiter)
        return Failed(waiter, error)

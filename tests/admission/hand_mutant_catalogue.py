"""The catalogue of hand-written semantic mutants of ``src/iop_admission`` (``make mutate-hand``).

mutmut flips one operator or constant at a time; these are the bugs a person writes: a call
skipped on one path, two statements swapped, a guard copied from a sibling method, a timer not
armed again, an event for one of many, a stale reference. Each is one exact text replacement in
one file (the text must occur exactly once: ``test_hand_mutant_catalogue.py`` checks it in
``make test``, so the catalogue cannot rot silently). Issue 32 started it with nine; issue 44
added the kinds its reviewers found surviving, and more of the same kinds. Grow it with every bug found: write the bug here
as it would have been written, then the test that kills it.
"""

from __future__ import annotations

from typing import NamedTuple

CORE = "src/iop_admission/"

SKIPPED_CALL = "skipped call"
SWAPPED_ORDER = "swapped order"
SIBLING_GUARD = "guard copied from a sibling"
TIMER = "timer not re-armed"
ONE_OF_MANY = "event for one of many"
STALE_REFERENCE = "stale reference"
OPERATOR = "operator or constant"


class HandMutant(NamedTuple):
    name: str
    kind: str
    path: str
    old: str
    new: str
    issue: int = 44


ISSUE_32 = (
    HandMutant(
        "the ejection threshold off by one",
        OPERATOR,
        CORE + "_core/health.py",
        "return bool(limit and p.failures >= limit)",
        "return bool(limit and p.failures > limit)",
        32,
    ),
    HandMutant(
        "a success does not reset the failure count",
        SKIPPED_CALL,
        CORE + "_core/health.py",
        "        p.failures = 0\n        return p.health is not HEALTHY\n",
        "        return p.health is not HEALTHY\n",
        32,
    ),
    HandMutant(
        "panic mode when some (not all) candidates are ejected: the choice index",
        SIBLING_GUARD,
        CORE + "_core/slots.py",
        "return self.eligible > 0 and self.admitting == 0",
        "return self.eligible > 0 and self.admitting < self.eligible",
        32,
    ),
    HandMutant(
        "panic mode when some (not all) candidates are ejected: a retry's scan",
        SIBLING_GUARD,
        CORE + "_core/choice.py",
        "        if p.admitting:\n            return False\n        found = True\n",
        "        if not p.admitting:\n            found = True\n",
        32,
    ),
    HandMutant(
        "one attempt too many",
        OPERATOR,
        CORE + "_core/state.py",
        "if lease.attempt >= self._refresh.config.retry.max_attempts:",
        "if lease.attempt > self._refresh.config.retry.max_attempts:",
        32,
    ),
    HandMutant(
        "a report from a fenced older generation counted",
        SIBLING_GUARD,
        CORE + "_core/health.py",
        "if p.epoch != lease._epoch or p.node.generation != lease.generation:",
        "if p.epoch != lease._epoch:",
        32,
    ),
    HandMutant(
        "the probe grant does not close the provider to normal grants",
        OPERATOR,
        CORE + "_core/health.py",
        "PROBE: True, PROBING: False}",
        "PROBE: True, PROBING: True}",
        32,
    ),
    HandMutant(
        "a queued retry goes to the tail of the waiter order",
        OPERATOR,
        CORE + "_core/queue.py",
        "if not waiters or next(reversed(waiters)) < waiter.seq:",
        "if True:",
        32,
    ),
    HandMutant(
        "a refresh forgets which providers a queued retry tried",
        STALE_REFERENCE,
        CORE + "_core/queue.py",
        "w._candidates = untried(group.providers, w.tried)",
        "w._candidates = group.providers",
        32,
    ),
)

HEALTH = (
    HandMutant(
        "a retry whose grant starts a probe leaves the panic grants undispatched (core)",
        SKIPPED_CALL,
        CORE + "_core/state.py",
        "            self._tenants.charge(again, tenant, cost)\n            self._probe_started(again)\n",
        "            self._tenants.charge(again, tenant, cost)\n",
    ),
    HandMutant(
        "the trio layer carries out a request's drained decisions, not a retry's",
        SIBLING_GUARD,
        CORE + "_layers/trio_handoff.py",
        "        shed = core.drain_decisions()",
        "        shed = core.drain_decisions() if retry_of is None else []",
    ),
    HandMutant(
        "the asyncio layer carries out a request's drained decisions, not a retry's",
        SIBLING_GUARD,
        CORE + "_layers/aio_handoff.py",
        "        shed = core.drain_decisions()  #",
        "        shed = core.drain_decisions() if retry_of is None else []  #",
    ),
    HandMutant(
        "an ejection grants no waiter it puts in panic mode",
        SKIPPED_CALL,
        CORE + "_core/state.py",
        "        return [self._health.eject(p, now), *self._dispatcher.dispatch(g for g, _ in p.groups)]\n",
        "        return [self._health.eject(p, now)]\n",
    ),
    HandMutant(
        "a restore grants no waiter",
        SKIPPED_CALL,
        CORE + "_core/state.py",
        "        return [self._health.restore(p), *self._dispatcher.dispatch(g for g, _ in p.groups)]\n",
        "        return [self._health.restore(p)]\n",
    ),
    HandMutant(
        "an ejection's end does not put the provider back in its groups' index",
        SKIPPED_CALL,
        CORE + "_core/health.py",
        "            move(p, EJECTION_OVER)\n            p.reindex()\n        return due\n",
        "            move(p, EJECTION_OVER)\n        return due\n",
    ),
    HandMutant(
        "the asyncio layer's ejection timer is not armed again after it fires",
        TIMER,
        CORE + "_layers/aio_handoff.py",
        "        self.apply(self.core.advance(asyncio.get_running_loop().time()))\n        self.arm_ejection()\n",
        "        self.apply(self.core.advance(asyncio.get_running_loop().time()))\n",
    ),
    HandMutant(
        "the trio layer's watcher is not woken by a new ejection",
        TIMER,
        CORE + "_layers/trio_handoff.py",
        "            self.ejection_wakeup.set()",
        "            pass",
    ),
    HandMutant(
        "a failure report does not end an ejection whose time has come (trio)",
        SKIPPED_CALL,
        CORE + "_layers/trio.py",
        "        self._handoff.advance(now)\n        self._handoff.apply(self._core.report_failure(lease, now))\n",
        "        self._handoff.apply(self._core.report_failure(lease, now))\n",
    ),
    HandMutant(
        "a success report does not end an ejection whose time has come (trio)",
        SKIPPED_CALL,
        CORE + "_layers/trio.py",
        "        self._handoff.advance(now)\n        self._handoff.apply(self._core.report_success(lease, now))\n",
        "        self._handoff.apply(self._core.report_success(lease, now))\n",
    ),
)

QUEUE = (
    HandMutant(
        "the asyncio layer says timed_out for one of two waiters expiring in one instant",
        ONE_OF_MANY,
        CORE + "_layers/aio_handoff.py",
        "            if self.subscribers:\n                waited = now - expired.enqueue_time\n",
        "            if self.subscribers and expired is waiter:\n                waited = now - expired.enqueue_time\n",
    ),
    HandMutant(
        "expire returns only the first of the waiters past their deadline",
        ONE_OF_MANY,
        CORE + "_core/queue.py",
        "            self.remove(waiter, TIMED_OUT)\n        return out\n",
        "            self.remove(waiter, TIMED_OUT)\n        return out[:1]\n",
    ),
    HandMutant(
        "advance ends only the first of the ejections due",
        ONE_OF_MANY,
        CORE + "_core/health.py",
        "        for p in due:\n",
        "        for p in due[:1]:\n",
    ),
    HandMutant(
        "a disconnect fails only the first of the waiters it strands",
        ONE_OF_MANY,
        CORE + "_core/queue.py",
        "return [self.fail(w, Unavailable(w.model, w.long)) for w in stranded]",
        "return [self.fail(w, Unavailable(w.model, w.long)) for w in stranded[:1]]",
    ),
    HandMutant(
        "fencing revokes only the first lease of a provider",
        ONE_OF_MANY,
        CORE + "_core/connectivity.py",
        "            for lease in tuple(p.leases.values()):\n",
        "            for lease in tuple(p.leases.values())[:1]:\n",
    ),
    HandMutant(
        "a provider leaving the config keeps its held long runs in its long count",
        SKIPPED_CALL,
        CORE + "_core/slots.py",
        "        self.long_in_flight -= self.held_long\n        self.held = self.held_long = 0\n",
        "        self.held = self.held_long = 0\n",
    ),
    HandMutant(
        "a provider leaving the config keeps its count of held long runs",
        SIBLING_GUARD,
        CORE + "_core/slots.py",
        "        self.long_in_flight -= self.held_long\n        self.held = self.held_long = 0\n",
        "        self.long_in_flight -= self.held_long\n        self.held = 0\n",
    ),
)

TENANTS = (
    HandMutant(
        "a full queue sheds before the tenant's own max_queue refuses the request",
        SWAPPED_ORDER,
        CORE + "_core/state.py",
        '        fair.check_queue(name)\n        if queue.full():\n            victim = tenants.shed_victim(name, model, queue.max_queue)\n            self._pending.append(queue.fail(victim, TenantLimitExceeded(victim.tenant, "shed", queue.max_queue)))\n',
        '        if queue.full():\n            victim = tenants.shed_victim(name, model, queue.max_queue)\n            self._pending.append(queue.fail(victim, TenantLimitExceeded(victim.tenant, "shed", queue.max_queue)))\n        fair.check_queue(name)\n',
    ),
    HandMutant(
        "settle ignored once the lease was released or fenced",
        SIBLING_GUARD,
        CORE + "_core/tenants.py",
        "        if ticket is not None and self.tenancy is not None:\n            self.tenancy.fair.settle(ticket, actual)\n",
        "        if ticket is not None and self.tenancy is not None and not lease._released:\n            self.tenancy.fair.settle(ticket, actual)\n",
    ),
    HandMutant(
        "a band move keeps the tag against the old band's virtual time",
        STALE_REFERENCE,
        CORE + "_fairness.py",
        "        state.finish = self._vtime.get(spec.priority, 0.0) + lead",
        "        state.finish = self._vtime.get(old.priority, 0.0) + lead",
    ),
    HandMutant(
        "an at-once grant does not raise its band's virtual time",
        SKIPPED_CALL,
        CORE + "_fairness.py",
        "        self._vtime[band] = max(self._vtime.get(band, 0.0), start)\n",
        "",
    ),
    HandMutant(
        "an at-once grant does not re-key its tenant",
        SKIPPED_CALL,
        CORE + "_fairness.py",
        "        ticket = Ticket(spec.name, item, cost, seq, granted=True, charged=cost)\n        self._touch(state)\n",
        "        ticket = Ticket(spec.name, item, cost, seq, granted=True, charged=cost)\n",
    ),
    HandMutant(
        "a dropped tenant still takes new requests",
        STALE_REFERENCE,
        CORE + "_fairness.py",
        "return name if name is not None and name in self._configured else DEFAULT_TENANT",
        "return name if name is not None and name in self._tenants else DEFAULT_TENANT",
    ),
    HandMutant(
        "a dropped tenant stays after its last lease",
        SKIPPED_CALL,
        CORE + "_fairness.py",
        "            self._touch(state)  # back under its cap: it may be served again (else its heap entry stands)\n"
        "        self._forget_drained(state)\n",
        "            self._touch(state)  # back under its cap: it may be served again (else its heap entry stands)\n",
    ),
    HandMutant(
        "fencing does not free the tenant slot of a revoked lease",
        SKIPPED_CALL,
        CORE + "_core/connectivity.py",
        "                self._tenants.release_ticket(lease)\n",
        "",
    ),
)

MORE = (
    HandMutant(
        "the trio layer ends no ejection before a retry",
        SIBLING_GUARD,
        CORE + "_layers/trio_handoff.py",
        "        self.advance(now)\n",
        "        if retry_of is None:\n            self.advance(now)\n",
    ),
    HandMutant(
        "a tenant's request whose grant starts a probe leaves the panic grants undispatched",
        SKIPPED_CALL,
        CORE + "_core/state.py",
        "            tenants.charge(lease, name, cost)\n            self._probe_started(lease)\n",
        "            tenants.charge(lease, name, cost)\n",
    ),
    HandMutant(
        "a release asks whether its tenant was capped after freeing the slot",
        SWAPPED_ORDER,
        CORE + "_core/tenants.py",
        "        capped = not fair.can_run(ticket.tenant)\n        fair.release(ticket)\n",
        "        fair.release(ticket)\n        capped = not fair.can_run(ticket.tenant)\n",
    ),
    HandMutant(
        "a refund moves the tag behind its band's virtual time",
        SKIPPED_CALL,
        CORE + "_fairness.py",
        "        state.finish = max(state.finish + delta / state.spec.weight, self._vtime.get(state.spec.priority, 0.0))",
        "        state.finish = state.finish + delta / state.spec.weight",
    ),
    HandMutant(
        "a weight change rescales the lead the wrong way",
        OPERATOR,
        CORE + "_fairness.py",
        "lead * old.weight / spec.weight",
        "lead * spec.weight / old.weight",
    ),
    HandMutant(
        "fencing forgets the runs held elsewhere but not the long ones",
        SIBLING_GUARD,
        CORE + "_core/slots.py",
        "        self.held = self.held_long = 0\n",
        "        self.held = 0\n",
    ),
    HandMutant(
        "a tenant back under its cap is not re-keyed",
        SKIPPED_CALL,
        CORE + "_fairness.py",
        "        if cap is not None and state.in_flight < cap <= state.in_flight + 1:\n            self._touch(state)",
        "        if cap is not None and state.in_flight < cap <= state.in_flight + 1:\n            pass",
    ),
)

WAKE_UPS = (
    HandMutant(
        "a lower count of long runs held elsewhere wakes nobody",
        SIBLING_GUARD,
        CORE + "_core/pool.py",
        "return slot if step < 0 or long_step < 0 else None",
        "return slot if step < 0 else None",
    ),
    HandMutant(
        "a disconnect puts no group in panic mode",
        SKIPPED_CALL,
        CORE + "_core/connectivity.py",
        "        elif self._health.unhealthy:  # groups left with only ejected candidates enter panic mode\n",
        "        elif False:\n",
    ),
    HandMutant(
        "a release looks at queued retries only when its groups have waiters",
        SKIPPED_CALL,
        CORE + "_core/state.py",
        "        if self._queue.retries:\n            return dispatch(map(GROUP, slot.groups))\n",
        "",
    ),
)

FAST_PATHS = (  # issue 42: the lease's fast paths skip work only where it is provably not needed
    HandMutant(
        "a provider linked into a new group of several still skips the heaps on a grant",
        STALE_REFERENCE,
        CORE + "_core/slots.py",
        "p.indexed = p.indexed or self.single is None",
        "p.indexed = p.indexed",
        42,
    ),
    HandMutant(
        "a release that reopens a probe re-enters only the heaps, not the admitting counts",
        SIBLING_GUARD,
        CORE + "_core/state.py",
        "        if reopened or slot.indexed:",
        "        if slot.indexed:",
        42,
    ),
    HandMutant(
        "a grant that starts a probe re-enters only the heaps, not the admitting counts",
        SIBLING_GUARD,
        CORE + "_core/dispatch.py",
        "            self._health.start_probe(p, lease)\n            p.reindex()\n        elif p.indexed:",
        "            self._health.start_probe(p, lease)\n            if p.indexed:\n                p.reindex()\n        elif p.indexed:",
        42,
    ),
    HandMutant(
        "an unrevocable lease that waited keeps the queue's scope as its body scope (trio)",
        STALE_REFERENCE,
        CORE + "_layers/trio_handoff.py",
        "                scope.__exit__(None, None, None)\n            return\n",
        "                scope.__exit__(None, None, None)\n                self._bodies[lease] = scope\n            return\n",
        42,
    ),
    HandMutant(
        "revocable=False ignored: fencing cancels the body anyway (trio)",
        SIBLING_GUARD,
        CORE + "_layers/trio_handoff.py",
        "        if not revocable:  # no body scope",
        "        if False:  # no body scope",
        42,
    ),
    HandMutant(
        "revocable=False ignored: fencing cancels the body anyway (asyncio)",
        SIBLING_GUARD,
        CORE + "_layers/aio_handoff.py",
        "        if revocable:\n            self.bodies[lease] = task\n",
        "        self.bodies[lease] = task\n",
        42,
    ),
    HandMutant(
        "an unrevocable body that ran revoked leaves without LeaseRevoked (asyncio)",
        SKIPPED_CALL,
        CORE + "_layers/aio_handoff.py",
        "        if task is None and lease.revoked and exc_type is None:\n",
        "        if False:\n",
        42,
    ),
    HandMutant(
        "a dispatch looks for the probes its grants started only when no provider is unhealthy",
        OPERATOR,
        CORE + "_core/dispatch.py",
        "d.lease.probe] if self._health.unhealthy else []",
        "d.lease.probe] if not self._health.unhealthy else []",
        42,
    ),
    HandMutant(
        "a queued request's fast check forgets the token budgets (queued where no budget could hold it)",
        SIBLING_GUARD,
        CORE + "_core/slots.py",
        "        if not self.budgeted and (self.long_eligible if long else self.eligible) > 0:",
        "        if (self.long_eligible if long else self.eligible) > 0:",
        42,
    ),
    HandMutant(
        "a grant in the tick its queue deadline is due keeps the queue's scope for the body (trio)",
        OPERATOR,
        CORE + "_layers/trio_handoff.py",
        "            if granted >= timer.deadline:",
        "            if granted > timer.deadline:",
        42,
    ),
    HandMutant(
        "the asyncio layer takes the cached loop's task in any thread",
        STALE_REFERENCE,
        CORE + "_layers/aio_handoff.py",
        "if loop is not None and self.thread == get_ident() else None",
        "if loop is not None else None",
        42,
    ),
)

DRAINS = (
    HandMutant(
        "drain_decisions hands over only the first of its decisions",
        ONE_OF_MANY,
        CORE + "_core/state.py",
        "        return self._dispatcher.with_unpinned(out) if self._budgets.unpinned else out\n",
        "        return (self._dispatcher.with_unpinned(out) if self._budgets.unpinned else out)[:1]\n",
    ),
)

LEDGER = (  # issue 40's token ledger: _ledger.py, _core/budgets.py and its hooks
    HandMutant(
        "a waiter that leaves unserved keeps its tokens held as headroom",
        SKIPPED_CALL,
        CORE + "_core/queue.py",
        "        if waiter._passed is not None and state is not GRANTED:  # granted: forgotten once it reserved\n"
        "            self._budgets.forget(waiter)\n",
        "",
        40,
    ),
    HandMutant(
        "a waiter that leaves gives its headroom back but drain_decisions grants nobody it lets in",
        SKIPPED_CALL,
        CORE + "_core/state.py",
        "        return self._dispatcher.with_unpinned(out) if self._budgets.unpinned else out\n",
        "        return out\n",
        40,
    ),
    HandMutant(
        "a pinned waiter granted on another provider keeps its headroom held",
        SKIPPED_CALL,
        CORE + "_core/dispatch.py",
        "            if charge._passed is not None:  # reserved: its count and pin elsewhere go to the next\n"
        "                self._budgets.forget(charge)\n",
        "",
        40,
    ),
    HandMutant(
        "headroom given back inside a dispatch is not dispatched again",
        ONE_OF_MANY,
        CORE + "_core/dispatch.py",
        "        while probed or freed:",
        "        while probed:",
        40,
    ),
    HandMutant(
        "a settle below zero is taken as a negative reservation",
        SKIPPED_CALL,
        CORE + "_ledger.py",
        "        used = max(0, used)\n",
        "",
        40,
    ),
    HandMutant(
        "a revoked lease's reservation is not returned when its body leaves",
        SIBLING_GUARD,
        CORE + "_core/pool.py",
        "        if slot.ledger is not None:\n            slot.ledger.release(lease.id)\n",
        "        if slot.ledger is not None and not lease._revoked:\n            slot.ledger.release(lease.id)\n",
        40,
    ),
    HandMutant(
        "the passed count records the granted tokens as the waiter's size",
        SWAPPED_ORDER,
        CORE + "_core/budgets.py",
        "ledger.passed_over(earliest.seq, need, granted)",
        "ledger.passed_over(earliest.seq, granted, need)",
        40,
    ),
    HandMutant(
        "a waiter kept off by the long slots is counted passed over by tokens",
        SKIPPED_CALL,
        CORE + "_core/budgets.py",
        "if earliest is None or (earliest.long and p.long_in_flight >= p.long_capacity):",
        "if earliest is None:",
        40,
    ),
    HandMutant(
        "a waiter kept off by its tenant's cap is counted passed over by tokens",
        SKIPPED_CALL,
        CORE + "_core/budgets.py",
        "        if not self._tenants.can_run(earliest.tenant):\n            return  # its tenant's cap keeps it waiting\n",
        "",
        40,
    ),
    HandMutant(
        "a lower budget keeps a pin whose headroom it can no longer hold",
        SKIPPED_CALL,
        CORE + "_ledger.py",
        "        if self.pinned is not None and self.headroom > budget:\n            self.forget(self.pinned)\n",
        "",
        40,
    ),
)

LEDGER_MUTMUT = (  # issue 40: the most telling of make mutate's survivors over the ledger, as a person writes them
    HandMutant(
        "a waiter passed over on a second provider is not recorded there (its pin there outlives it)",
        ONE_OF_MANY,
        CORE + "_core/budgets.py",
        "        if earliest._passed is None:\n            earliest._passed = [p]\n"
        "        elif p not in earliest._passed:\n            earliest._passed.append(p)\n",
        "        if earliest._passed is None:\n            earliest._passed = [p]\n",
        40,
    ),
    HandMutant(
        "long waiters are never counted as passed over by tokens",
        ONE_OF_MANY,
        CORE + "_core/budgets.py",
        "        for long in (False, True):\n",
        "        for long in (False,):\n",
        40,
    ),
    HandMutant(
        "a waiter that arrived after the grant is counted as passed over by it",
        SIBLING_GUARD,
        CORE + "_core/budgets.py",
        "if w is not None and w.seq < seq and (earliest is None or w.seq < earliest.seq):",
        "if w is not None and (earliest is None or w.seq < earliest.seq):",
        40,
    ),
    HandMutant(
        "a waiter that can never fit on a provider is pinned there (its headroom above the budget)",
        SIBLING_GUARD,
        CORE + "_core/budgets.py",
        "if not ledger.could_fit(need) or ledger.fits(need, earliest.seq):",
        "if ledger.fits(need, earliest.seq):",
        40,
    ),
    HandMutant(
        "a granted waiter's pins are dropped as it leaves the queue, before it reserves (the pin moves first)",
        SWAPPED_ORDER,
        CORE + "_core/queue.py",
        "        if waiter._passed is not None and state is not GRANTED:  # granted: forgotten once it reserved\n",
        "        if waiter._passed is not None:\n",
        40,
    ),
    HandMutant(
        "a refresh that moves a pinned waiter to a new group keeps its headroom on the provider it left",
        SKIPPED_CALL,
        CORE + "_core/queue.py",
        "            if w._passed is not None:  # no headroom held where it can no longer run\n"
        "                self._budgets.moved(w, group.providers)\n",
        "",
        40,
    ),
)

MUTANTS = ISSUE_32 + HEALTH + QUEUE + TENANTS + MORE + WAKE_UPS + FAST_PATHS + DRAINS + LEDGER + LEDGER_MUTMUT

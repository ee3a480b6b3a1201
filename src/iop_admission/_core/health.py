"""The health part of the admission core [outlier-ejection] [health-probe]: reports, ejection, probe, restore.

:class:`Health` owns the providers that are not healthy and the outlier policy;
it changes a provider's health fields and re-enters it in its groups' index.
Whom a change lets in is for :class:`~iop_admission.core.AdmissionState` to
dispatch: each method that can let waiters in returns the providers (or the
news) whose groups must be looked at.

A provider's :class:`ProviderHealth` changes in one place, :func:`move`, by the
one table :data:`TRANSITIONS` (as h11's ``_state.py`` keeps its transitions): the
methods below decide *which* event happened, the table says where it leads, and
an event the table does not list for the current state is a bug of the core
(:class:`HealthTransitionError`), never a silent change. Whether a state admits
normal grants (``ProviderSlot.admitting``) follows the state (:data:`ADMITS`).
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Mapping
from typing import Final, final

from iop_admission._config import OutlierPolicy, ProviderKey, ProviderReport

from .records import BudgetChanged, Decision, Ejected, Lease, Restored
from .slots import EJECTED, HEALTHY, PROBE, PROBING, ProviderHealth, ProviderSlot


@final
class HealthEvent(enum.Enum):
    """What happens to a provider's health; :data:`TRANSITIONS` says where each leads."""

    EJECT = "eject"  # failures in a row, a failed probe, a stall or not_ready report
    EJECTION_OVER = "ejection over"  # the ejection time passed: the next grant probes
    PROBE_GRANTED = "probe granted"
    PROBE_LOST = "probe lost"  # the probe ended without a report (cancelled, fenced)
    RESTORE = "restore"  # the probe's (or a panic grant's) success, or ready after not_ready
    FORGET = "forget"  # the provider left the config


EJECT = HealthEvent.EJECT
EJECTION_OVER = HealthEvent.EJECTION_OVER
PROBE_GRANTED = HealthEvent.PROBE_GRANTED
PROBE_LOST = HealthEvent.PROBE_LOST
RESTORE = HealthEvent.RESTORE
FORGET = HealthEvent.FORGET

# Every transition of a provider's health, and no other. A panic grant runs on an
# ejected, probe-due or probing provider, so its success restores from each of them;
# a report ejects a provider whose probe is due or running as a failure of the probe would.
TRANSITIONS: Final[Mapping[ProviderHealth, Mapping[HealthEvent, ProviderHealth]]] = {
    HEALTHY: {EJECT: EJECTED, FORGET: HEALTHY},
    EJECTED: {EJECTION_OVER: PROBE, RESTORE: HEALTHY, FORGET: HEALTHY},
    PROBE: {PROBE_GRANTED: PROBING, EJECT: EJECTED, RESTORE: HEALTHY, FORGET: HEALTHY},
    PROBING: {PROBE_LOST: PROBE, EJECT: EJECTED, RESTORE: HEALTHY, FORGET: HEALTHY},
}

# Whether a state takes normal grants: an ejected provider only in panic mode, a
# probing one not until its probe reports.
ADMITS: Final[Mapping[ProviderHealth, bool]] = {HEALTHY: True, EJECTED: False, PROBE: True, PROBING: False}


class HealthTransitionError(RuntimeError):
    """The core asked for a health change its table does not allow: a bug of the core, not of the caller."""


def move(p: ProviderSlot, event: HealthEvent) -> None:
    """Apply ``event`` to ``p``'s health by :data:`TRANSITIONS`; its ``admitting`` follows."""
    try:
        health = TRANSITIONS[p.health][event]
    except KeyError:
        raise HealthTransitionError(
            f"provider {p.key}: no health transition from {p.health.value} on {event.value}"
        ) from None
    p.health = health
    p.admitting = ADMITS[health]


class Health:
    """Passive health of the providers: who is ejected, probing or due a probe, and until when."""

    __slots__ = ("unhealthy", "outlier", "_ends", "_pushed")

    def __init__(self, outlier: OutlierPolicy) -> None:
        self.unhealthy: dict[ProviderKey, ProviderSlot] = {}  # ejected, probe due or probing
        self.outlier = outlier
        self._ends: list[tuple[float, int, ProviderSlot]] = []
        """A heap of the finite ejection ends, each with the slot it was set on; an end
        no longer in force (restored, re-ejected, turned into an ejection until ``ready``)
        stays until it reaches the top: the earliest end costs no walk of every ejection
        (a report of each of a thousand providers a second asks it after each)."""
        self._pushed = 0

    def next_ejection_end(self) -> float | None:
        """The earliest time an ejection ends, or None."""
        if not self.unhealthy:  # the usual case, asked before every lease
            self._ends.clear()
            return None
        ends = self._ends
        while ends:
            end, _, p = ends[0]
            if p.health is EJECTED and p.ejected_until == end and self.unhealthy.get(p.key) is p:
                return end
            heapq.heappop(ends)
        return None

    def reportable(self, lease: Lease, providers: Mapping[ProviderKey, ProviderSlot]) -> ProviderSlot | None:
        """The provider a report of ``lease`` concerns, or None if the report is stale."""
        if lease._reported:
            return None
        lease._reported = True
        p = lease._slot
        if providers.get(p.key) is not p or not p.configured:
            return None
        if p.epoch != lease._epoch or p.node.generation != lease.generation:
            return None
        return p

    def failure(self, p: ProviderSlot, lease: Lease) -> bool:
        """Count a failure of ``lease`` on ``p``; whether it ejects ``p``.

        On a healthy provider the ``outlier.consecutive_failures``-th failure in a
        row ejects it (0: never); on an ejected one only its probe's failure
        counts: it ejects the provider again, for twice as long (capped).
        """
        p.failures += 1
        if p.health is HEALTHY:
            limit = self.outlier.consecutive_failures
            return bool(limit and p.failures >= limit)
        return lease.probe and p.probe_lease == lease.id

    def success(self, p: ProviderSlot) -> bool:
        """Count a success on ``p``; whether it restores ``p`` (it was not healthy)."""
        p.failures = 0
        return p.health is not HEALTHY

    def eject(self, p: ProviderSlot, now: float) -> Ejected:
        p.streak += 1
        return self._take_out(p, self.outlier.ejection_time(p.streak), now)

    def _take_out(self, p: ProviderSlot, duration: float, now: float) -> Ejected:
        """Eject ``p`` for ``duration`` seconds (infinite: until a ``ready`` report)."""
        move(p, EJECT)
        p.epoch += 1
        p.probe_lease = 0
        p.ejected_until = now + duration
        p.ejections += 1
        self.unhealthy[p.key] = p
        if p.ejected_until != math.inf:
            self._pushed += 1
            heapq.heappush(self._ends, (p.ejected_until, self._pushed, p))
        p.reindex()
        return Ejected(p.key, p.ejected_until, duration, p.failures)

    def restore(self, p: ProviderSlot) -> Restored:
        move(p, RESTORE)
        p.failures = p.streak = p.probe_lease = 0
        p.epoch += 1
        del self.unhealthy[p.key]
        p.reindex()
        return Restored(p.key)

    def end_due(self, now: float) -> list[ProviderSlot]:
        """End every ejection whose time is ``<= now``: each such provider's probe may be granted now."""
        due = [p for p in self.unhealthy.values() if p.health is EJECTED and p.ejected_until <= now]
        for p in due:
            move(p, EJECTION_OVER)
            p.reindex()
        return due

    def start_probe(self, p: ProviderSlot, lease: Lease) -> None:
        """``lease`` was granted on ``p`` with its probe due: it is the probe; ``p`` stops admitting."""
        move(p, PROBE_GRANTED)
        p.probe_lease = lease.id
        p.probes += 1
        lease.probe = True

    def forget(self, p: ProviderSlot) -> None:
        """A provider left the config: it starts healthy if it comes back; its reports are stale."""
        p.reported, p.report_reason, p.reported_capacity = "", "", None
        self._engine(p, None, None, [])  # no news: the provider is gone
        move(p, FORGET)
        p.failures = p.streak = p.probe_lease = 0
        p.epoch += 1
        self.unhealthy.pop(p.key, None)

    def report(self, p: ProviderSlot | None, report: ProviderReport, now: float) -> list[Decision] | None:
        """A node's report of ``p`` [health-probe], beside the failures of its leases: the
        ``Ejected`` or ``Restored`` it causes; None for a stale report (``p`` not configured,
        its node offline or of another generation than the report's), which changes nothing.

        ``stalled`` ejects a provider that is not ejected as its consecutive failures would
        (for a growing time, then a probe). ``not_ready`` ejects it until a ``ready`` report
        (no probe before: the backend says it cannot serve), or turns the ejection it is in
        into one. ``ready`` ends such an ejection (``Restored``); it does not end one for
        failures or a stall, whose probe decides (a hung engine may answer its probe ready).
        A ``ready`` report's ``capacity`` lowers the provider's (never above the config's), and
        its engine view (``kv_use``, ``preemptions``) sets the cut of its token budget (a
        ``BudgetChanged`` after the health news when the effective budget moved)
        ([token-ledger]: :func:`~iop_admission._ledger.engine_cut`).
        """
        if p is None or not p.configured or not p.node.connected or report.generation not in (None, p.node.generation):
            return None
        news: list[Decision] = []
        if report.state == "ready":
            seen = (report.kv_use, report.preemptions)
            if seen != (None, None) or (p.reported_kv_use, p.reported_preemptions) != (None, None):
                self._engine(p, *seen, news)
        told = self._reported(p, report, now)
        return news if told is None else [told, *news]

    def _reported(self, p: ProviderSlot, report: ProviderReport, now: float) -> Ejected | Restored | None:
        p.reported, p.report_reason = report.state, report.reason
        if report.state == "ready":
            if p.reported_capacity != report.capacity:
                self._cap(p, report.capacity)
                p.reindex()
            if p.health is EJECTED and p.ejected_until == math.inf:
                return self.restore(p)
            return None
        if p.health is EJECTED:
            if report.state == "not_ready":
                p.ejected_until = math.inf
            return None
        if report.state == "stalled":
            return self.eject(p, now)
        return self._take_out(p, math.inf, now)

    def new_connection(self, p: ProviderSlot) -> list[Decision]:
        """``p``'s node connected again: its reports start over (the node sends them again), and the
        engine's cut with them (``BudgetChanged`` if that raises its budget); an ejection until
        ``ready`` ends with them (``Restored``), an ejection for failures or a stall does not."""
        p.reported, p.report_reason = "", ""
        if p.reported_capacity is not None:
            self._cap(p, None)
        news: list[Decision] = []
        self._engine(p, None, None, news)
        if p.health is EJECTED and p.ejected_until == math.inf:
            news.append(self.restore(p))
        return news

    @staticmethod
    def _engine(p: ProviderSlot, kv_use: float | None, preemptions: int | None, news: list[Decision]) -> None:
        """The engine's own view of ``p`` (None, None: forgotten): kept for the snapshot; with a
        token budget it sets the budget's cut, and a ``BudgetChanged`` goes to ``news`` when the
        effective budget moved. A preemption is a rise of the engine's count since its last report
        on this connection (a lower count: the engine restarted, none new)."""
        before = p.reported_preemptions
        preempted = preemptions is not None and before is not None and preemptions > before
        p.reported_kv_use, p.reported_preemptions = kv_use, preemptions
        ledger = p.ledger
        if ledger is not None:
            budget = ledger.budget
            ledger.engine_report(kv_use, preempted)
            if ledger.budget != budget:
                news.append(BudgetChanged(p.key, budget, ledger.budget))

    @staticmethod
    def _cap(p: ProviderSlot, capacity: int | None) -> None:
        """The backend's own parallelism: ``p``'s capacity is the smaller of it and its spec's."""
        p.reported_capacity = capacity
        p.capacity = p.spec.capacity if capacity is None else min(p.spec.capacity, capacity)

    def reopen_probe(self, p: ProviderSlot) -> None:
        """The probe ended without a report (cancelled, fenced): the next grant probes again."""
        move(p, PROBE_LOST)
        p.probe_lease = 0

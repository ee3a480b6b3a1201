"""The health part of the admission core [outlier-ejection] [health-probe]: reports, ejection, probe, restore.

:class:`Health` owns the providers that are not healthy and the outlier policy;
it changes a provider's health fields and re-enters it in its groups' index.
Whom a change lets in is for :class:`~iop_admission.core.AdmissionState` to
dispatch: each method that can let waiters in returns the providers (or the
news) whose groups must be looked at.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from iop_admission._config import OutlierPolicy, ProviderKey, ProviderReport

from .records import Decision, Ejected, Lease, Restored
from .slots import EJECTED, HEALTHY, PROBE, PROBING, ProviderSlot


class Health:
    """Passive health of the providers: who is ejected, probing or due a probe, and until when."""

    __slots__ = ("unhealthy", "outlier")

    def __init__(self, outlier: OutlierPolicy) -> None:
        self.unhealthy: dict[ProviderKey, ProviderSlot] = {}  # ejected, probe due or probing
        self.outlier = outlier

    def next_ejection_end(self) -> float | None:
        """The earliest time an ejection ends, or None."""
        if not self.unhealthy:  # the usual case, asked before every lease
            return None
        ends = [p.ejected_until for p in self.unhealthy.values() if p.health is EJECTED]
        end = min(ends, default=math.inf)
        return None if end == math.inf else end

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
        p.health = EJECTED
        p.admitting = False
        p.epoch += 1
        p.probe_lease = 0
        p.ejected_until = now + duration
        p.ejections += 1
        self.unhealthy[p.key] = p
        p.reindex()
        return Ejected(p.key, p.ejected_until, duration, p.failures)

    def restore(self, p: ProviderSlot) -> Restored:
        p.health = HEALTHY
        p.admitting = True
        p.failures = p.streak = p.probe_lease = 0
        p.epoch += 1
        del self.unhealthy[p.key]
        p.reindex()
        return Restored(p.key)

    def end_due(self, now: float) -> list[ProviderSlot]:
        """End every ejection whose time is ``<= now``: each such provider's probe may be granted now."""
        due = [p for p in self.unhealthy.values() if p.health is EJECTED and p.ejected_until <= now]
        for p in due:
            p.health = PROBE
            p.admitting = True
            p.reindex()
        return due

    def start_probe(self, p: ProviderSlot, lease: Lease) -> None:
        """``lease`` was granted on ``p`` with its probe due: it is the probe; ``p`` stops admitting."""
        p.health = PROBING
        p.admitting = False
        p.probe_lease = lease.id
        p.probes += 1
        lease.probe = True

    def forget(self, p: ProviderSlot) -> None:
        """A provider left the config: it starts healthy if it comes back; its reports are stale."""
        p.reported, p.report_reason, p.reported_capacity = "", "", None
        p.health = HEALTHY
        p.admitting = True
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
        A ``ready`` report's ``capacity`` lowers the provider's (never above the config's).
        """
        if p is None or not p.configured or not p.node.connected or report.generation not in (None, p.node.generation):
            return None
        news = self._reported(p, report, now)
        return [] if news is None else [news]

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

    def new_connection(self, p: ProviderSlot) -> Restored | None:
        """``p``'s node connected again: its reports start over (the node sends them again);
        an ejection until ``ready`` ends with them, an ejection for failures or a stall does not."""
        p.reported, p.report_reason = "", ""
        if p.reported_capacity is not None:
            self._cap(p, None)
        if p.health is EJECTED and p.ejected_until == math.inf:
            return self.restore(p)
        return None

    @staticmethod
    def _cap(p: ProviderSlot, capacity: int | None) -> None:
        """The backend's own parallelism: ``p``'s capacity is the smaller of it and its spec's."""
        p.reported_capacity = capacity
        p.capacity = p.spec.capacity if capacity is None else min(p.spec.capacity, capacity)

    def reopen_probe(self, p: ProviderSlot) -> None:
        """The probe ended without a report (cancelled, fenced): the next grant probes again."""
        p.health = PROBE
        p.admitting = True
        p.probe_lease = 0

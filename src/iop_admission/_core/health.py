"""The health part of the admission core [outlier-ejection]: reports, ejection, probe, restore.

:class:`Health` owns the providers that are not healthy and the outlier policy;
it changes a provider's health fields and re-enters it in its groups' index.
Whom a change lets in is for :class:`~iop_admission.core.AdmissionState` to
dispatch: each method that can let waiters in returns the providers (or the
news) whose groups must be looked at.
"""

from __future__ import annotations

from collections.abc import Mapping

from iop_admission._config import OutlierPolicy, ProviderKey

from .records import Ejected, Lease, Restored
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
        return min(ends) if ends else None

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
        duration = self.outlier.ejection_time(p.streak)
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
        p.health = HEALTHY
        p.admitting = True
        p.failures = p.streak = p.probe_lease = 0
        p.epoch += 1
        self.unhealthy.pop(p.key, None)

    def reopen_probe(self, p: ProviderSlot) -> None:
        """The probe ended without a report (cancelled, fenced): the next grant probes again."""
        p.health = PROBE
        p.admitting = True
        p.probe_lease = 0

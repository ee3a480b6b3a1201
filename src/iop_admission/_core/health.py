"""Passive health of providers [outlier-ejection]: reports, ejection, probe, restore."""

from __future__ import annotations

from .choice import groups_of
from .records import Decision, Ejected, Lease, Restored
from .shared import StateCore
from .slots import EJECTED, HEALTHY, PROBE, ProviderSlot


class HealthRules(StateCore):
    """The health side of :class:`~iop_admission.core.AdmissionState` (see its module docstring)."""

    def next_ejection_end(self) -> float | None:
        """The earliest time an ejection ends (pass it to :meth:`advance`), or None."""
        ends = [p.ejected_until for p in self._unhealthy.values() if p.health is EJECTED]
        return min(ends) if ends else None

    def panic_models(self) -> tuple[str, ...]:
        """Model keys in panic mode: every eligible candidate is ejected or probing."""
        return tuple(name for name, g in self._groups.items() if g.in_panic(False))

    def report_failure(self, lease: Lease, now: float) -> list[Decision]:
        """Count a provider failure of ``lease`` (once per lease; stale reports change nothing).

        On a healthy provider the ``outlier.consecutive_failures``-th failure in a
        row ejects it (0: never); on an ejected one only its probe's failure
        counts: it ejects the provider again, for twice as long (capped).

        Returns:
            ``Ejected`` and the grants it causes (waiters entering panic mode).
        """
        self._now = max(self._now, now)
        p = self._reportable(lease)
        if p is None:
            return []
        p.failures += 1
        if p.health is HEALTHY:
            limit = self._config.outlier.consecutive_failures
            if limit and p.failures >= limit:
                return self._eject(p, now)
            return []
        if lease.probe and p.probe_lease == lease.id:
            return self._eject(p, now)
        return []

    def report_success(self, lease: Lease, now: float) -> list[Decision]:
        """Count a success of ``lease`` (once per lease; stale reports change nothing).

        A success resets the failure count; on an ejected provider (its probe,
        or a lease granted in panic mode during the ejection) it restores it.

        Returns:
            ``Restored`` and the grants it causes; empty for a healthy provider.
        """
        self._now = max(self._now, now)
        p = self._reportable(lease)
        if p is None:
            return []
        p.failures = 0
        if p.health is HEALTHY:
            return []
        return self._restore(p)

    def advance(self, now: float) -> list[Decision]:
        """End every ejection whose time is ``<= now``: its probe may be granted now.

        Returns:
            The grants this causes (the probe goes to the earliest waiter that can use it).
        """
        self._now = max(self._now, now)
        due = [p for p in self._unhealthy.values() if p.health is EJECTED and p.ejected_until <= now]
        for p in due:
            p.health = PROBE
            p.admitting = True
            p.reindex()
        return self._dispatch(groups_of(due)) if due else []

    def _reportable(self, lease: Lease) -> ProviderSlot | None:
        """The provider a report of ``lease`` concerns, or None if the report is stale."""
        if lease._reported:
            return None
        lease._reported = True
        p = lease._slot
        if self._providers.get(p.key) is not p or not p.configured:
            return None
        if p.epoch != lease._epoch or p.node.generation != lease.generation:
            return None
        return p

    def _eject(self, p: ProviderSlot, now: float) -> list[Decision]:
        p.streak += 1
        duration = self._config.outlier.ejection_time(p.streak)
        p.health = EJECTED
        p.admitting = False
        p.epoch += 1
        p.probe_lease = 0
        p.ejected_until = now + duration
        p.ejections += 1
        self._unhealthy[p.key] = p
        p.reindex()
        decisions: list[Decision] = [Ejected(p.key, p.ejected_until, duration, p.failures)]
        decisions.extend(self._dispatch(g for g, _ in p.groups))
        return decisions

    def _restore(self, p: ProviderSlot) -> list[Decision]:
        p.health = HEALTHY
        p.admitting = True
        p.failures = p.streak = p.probe_lease = 0
        p.epoch += 1
        del self._unhealthy[p.key]
        p.reindex()
        decisions: list[Decision] = [Restored(p.key)]
        decisions.extend(self._dispatch(g for g, _ in p.groups))
        return decisions

    def _forget_health(self, p: ProviderSlot) -> None:
        """A provider left the config: it starts healthy if it comes back; its reports are stale."""
        p.health = HEALTHY
        p.admitting = True
        p.failures = p.streak = p.probe_lease = 0
        p.epoch += 1
        self._unhealthy.pop(p.key, None)

    def _reopen_probe(self, p: ProviderSlot) -> None:
        """The probe ended without a report (cancelled, fenced): the next grant probes again."""
        p.health = PROBE
        p.admitting = True
        p.probe_lease = 0

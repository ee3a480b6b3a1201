"""Lifecycle events of admission, shared by the trio and the asyncio layers.

Events are best effort: subscribers get them through bounded buffers, a full
buffer drops the event and counts it, and no correctness path reads them.
"""

from __future__ import annotations

from typing import final

import attrs

from iop_admission._config import ProviderKey
from iop_admission.core import BudgetChanged, Ejected, Lease, Restored

__all__ = ["AdmissionEvent", "HealthNews", "health_event", "lease_event", "rejected_event"]

HealthNews = Ejected | Restored | BudgetChanged
"""The decisions a layer tells as provider news (events), and has nothing else to carry out for but
an ejection's timer."""


@final
@attrs.frozen
class AdmissionEvent:
    """One lifecycle event, as delivered by :meth:`Admission.subscribe`.

    Attributes:
        kind: ``granted``, ``queued``, ``released``, ``revoked``, ``timed_out``,
            ``rejected``, ``connected``,
            ``disconnected``, ``refreshed``, ``ejected``, ``restored``, ``retried`` or
            ``budget_changed``.
        time: the layer's clock when emitted: ``trio.current_time()``, or the
            asyncio loop's ``loop.time()`` for :class:`~iop_admission.aio.AsyncAdmission`.
        model, provider, lease_id, generation, node_id, long: what it concerns
            (for ``retried``: the provider and lease that failed).
        reason: for ``rejected`` and failed waiters, the error class name
            (``QueueFull``, ``Unavailable``, ``ModelNotFound``); for ``retried``
            the caller's reason.
        waited: seconds queued, for ``granted`` and ``timed_out``.
        attempt: for ``retried``, the number of the new attempt.
        duration: for ``ejected``, the ejection's length in seconds.
        failures: for ``ejected``, the consecutive failures counted.
        tenant: for lease events and ``queued``, the tenant the request is
            charged to, and for a ``rejected`` ``TenantLimitExceeded`` the tenant
            refused, when tenants are configured ([tenant-fair-share]); None otherwise.
        token_budget: for ``budget_changed``, the provider's effective token budget now (the
            engine's report lowered it below, or raised it back toward, ``total_context_tokens``;
            ``reason`` says ``lowered`` or ``raised``) [token-ledger].
    """

    kind: str
    time: float | None = None
    model: str | None = None
    provider: ProviderKey | None = None
    lease_id: int | None = None
    generation: int | None = None
    node_id: str | None = None
    long: bool = False
    reason: str | None = None
    waited: float | None = None
    attempt: int | None = None
    duration: float | None = None
    failures: int | None = None
    tenant: str | None = None
    token_budget: int | None = None


def lease_event(
    kind: str,
    time: float | None,
    lease: Lease,
    *,
    waited: float | None = None,
    attempt: int | None = None,
    reason: str | None = None,
) -> AdmissionEvent:
    """The event ``kind`` about ``lease``."""
    return AdmissionEvent(
        kind,
        time,
        model=lease.model,
        provider=lease.provider,
        lease_id=lease.id,
        generation=lease.generation,
        node_id=lease.provider.node_id,
        long=lease.long,
        reason=reason,
        waited=waited,
        attempt=attempt,
        tenant=lease.tenant if lease._ticket is not None else None,
    )


def rejected_event(time: float | None, model: str, long: bool, exc: BaseException) -> AdmissionEvent:
    """The ``rejected`` event of a request on ``model`` that failed with ``exc``."""
    tenant = getattr(exc, "tenant", None)  # a TenantLimitExceeded names its tenant
    return AdmissionEvent("rejected", time, model=model, long=long, reason=type(exc).__name__, tenant=tenant)


def health_event(time: float | None, decision: HealthNews) -> AdmissionEvent:
    """The ``ejected``, ``restored`` or ``budget_changed`` event of a provider's health decision."""
    key = decision.provider
    if type(decision) is BudgetChanged:
        reason = "lowered" if decision.budget < decision.before else "raised"
        return AdmissionEvent(
            "budget_changed", time, provider=key, node_id=key.node_id, reason=reason, token_budget=decision.budget
        )
    if type(decision) is Ejected:
        return AdmissionEvent(
            "ejected", time, provider=key, node_id=key.node_id, duration=decision.duration, failures=decision.failures
        )
    return AdmissionEvent("restored", time, provider=key, node_id=key.node_id)

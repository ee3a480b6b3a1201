"""What one request costs its tenant at the Edge ([tenant-edge]): which tenant, the reserve, the settlement.

The admission core orders grants among tenants (bands, weighted fair share,
quotas); the Edge says whose request it is and what it costs. The tenant is
the one the request's API key belongs to (or, only when ``tenant_header`` is
set, the one a trusted front proxy names); the cost is 1 per request, or with
``tenant_cost: tokens`` the estimate (prompt characters / 4 + ``max_tokens``)
reserved at admission and settled with the backend's ``usage.total_tokens``
when the run ends. A tenant's quota refusal is a 429 whose code names the
limit and whose ``Retry-After`` is the tenant's own. On a provider that admits by
tokens, the same usage settles the request's context-token reservation the moment
the answer reports it ([token-ledger]): before the last bytes reach the client and
the lease is released.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar, final

from iop_admission import Admission, AdmissionError, Lease, TenantLimitExceeded
from iop_edge.api.rejections import OWS, RequestRejected, bearer
from iop_edge.listener.pacing import Headers

if TYPE_CHECKING:
    from iop_edge.api.app import EdgeParts
    from iop_edge.config import EdgeConfig
    from iop_edge.front_door.head_refusal import HeadRefusal

__all__ = ["TENANT_REFUSAL_CODES", "Charge", "charge_of", "refusal_of", "tenant_retry_after"]

_Seen = TypeVar("_Seen", bytes, list[bytes])

#: ``TenantLimitExceeded.limit`` -> the 429's error code (``queue``: the whole queue, as without tenants).
TENANT_REFUSAL_CODES = {"max_queue": "tenant_max_queue", "shed": "tenant_shed", "queue": "queue_full"}

_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*([0-9]+)')
USAGE_WINDOW = 64 * 1024
"""Bytes after a whole answer's last ``"usage"`` in which its ``total_tokens`` is looked for (:meth:`Charge.scan_parts`)."""


@final
class Charge:
    """One request's tenant and reserve; :meth:`scan` finds the usage the backend reported."""

    __slots__ = ("cost", "tenant", "tokens", "used", "context")

    def __init__(self, tenant: str | None, cost: float, *, tokens: bool) -> None:
        self.tenant = tenant
        self.cost = cost
        self.tokens = tokens
        self.used: int | None = None
        self.context: int | None = None  # context tokens to reserve on a token budget ([token-ledger])

    def scan(self, data: bytes) -> None:
        """Note the latest ``usage.total_tokens`` in relayed answer bytes (a whole body or a stream burst)."""
        at = data.rfind(b'"usage"')
        if at >= 0:
            found = _TOTAL_TOKENS.search(data, at)
            if found is not None:
                self.used = int(found.group(1))

    def scan_parts(self, parts: list[bytes]) -> None:
        """:meth:`scan` over the pieces of one whole answer, never joined: from the last piece back
        to the one holding the last ``"usage"``, each with the start of what follows it (a key or
        a number across two pieces is found), the reported total read within :data:`USAGE_WINDOW` bytes."""
        following = b""
        for part in reversed(parts):
            data = part + following if following else part
            at = data.rfind(b'"usage"')
            if at >= 0:
                found = _TOTAL_TOKENS.search(data, at, at + USAGE_WINDOW)
                if found is not None:
                    self.used = int(found.group(1))
                return
            following = data[:USAGE_WINDOW]

    @property
    def reads_usage(self) -> bool:
        """Whether the answer's bytes are read for its usage: token cost, or a context reservation."""
        return self.tokens or self.context is not None

    def scanners(
        self, admission: Admission, lease: Lease
    ) -> tuple[Callable[[bytes], None], Callable[[list[bytes]], None]]:
        """:meth:`scan` (a stream's bursts) and :meth:`scan_parts` (a whole answer) for ``lease``'s
        attempt; with a context reservation, a usage they find also settles it at once
        (``settle_tokens``: what the run really used; a no-op off a budget)."""
        self.used = None  # this attempt's usage only
        if self.context is None:
            return self.scan, self.scan_parts

        def settling(scan: Callable[[_Seen], None]) -> Callable[[_Seen], None]:
            def scan_and_settle(data: _Seen) -> None:
                before = self.used
                scan(data)
                if self.used is not None and self.used != before:
                    admission.settle_tokens(lease, self.used)

            return scan_and_settle

        return settling(self.scan), settling(self.scan_parts)

    def reserve(self, admission: Admission, lease: Lease) -> None:
        """A retry's lease carries the cost its failed attempt settled at (0): charge it the
        request's reserve again (token cost only; the retry is an attempt of its own)."""
        if self.tokens and lease.cost != self.cost:
            admission.settle(lease, self.cost)

    def settle(self, admission: Admission, lease: Lease, *, answered: bool) -> None:
        """Charge ``lease``'s tenant what its attempt used (token cost only): the reported usage, 0
        for an attempt that failed before any byte (it is retried or refused), else the reserve."""
        if not self.tokens:
            return
        used, self.used = self.used, None
        if used is not None:
            admission.settle(lease, float(used))
        elif not answered:
            admission.settle(lease, 0.0)


def charge_of(config: EdgeConfig, headers: Headers, estimate: Callable[[], int]) -> Charge:
    """The tenant and reserve of a request with ``headers`` (``estimate()``: its tokens, read only in token mode)."""
    tokens = config.tenant_cost == "tokens" and bool(config.tenants)
    named = None
    if config.tenant_header is not None:
        wanted = config.tenant_header.lower().encode("latin-1")
        for name, value in headers:
            if name == wanted:
                named = value.decode("latin-1").strip(OWS)
                break
    tenant = config.tenant_of(bearer(headers), named) if config.tenants else None
    return Charge(tenant, float(max(1, estimate())) if tokens else 1.0, tokens=tokens)


def tenant_retry_after(admission: Admission, tenant: str, service_time: float, ceiling: float) -> int:
    """The tenant's own ``Retry-After`` (s): the time its queue takes to drain at its own pace, its
    waiters served ``in_flight`` at a time, one mean service time each; 1 to the queue timeout."""
    for row in admission.snapshot(count=0).tenants:
        if row.name == tenant:
            wait = service_time * (row.waiting + 1) / max(1, row.in_flight)
            return max(1, min(math.ceil(wait), math.ceil(ceiling)))
    return 1


def refusal_of(exc: AdmissionError, service: EdgeParts, head_refusal: HeadRefusal) -> RequestRejected:
    """The 429 of a tenant's quota (code :data:`TENANT_REFUSAL_CODES`, counted per tenant), else the
    usual answer to ``exc``."""
    if not isinstance(exc, TenantLimitExceeded):
        return head_refusal.admission_refusal(exc)
    admission = service.admission
    code = TENANT_REFUSAL_CODES.get(exc.limit, "tenant_" + exc.limit)
    service.metrics.tenant_rejected(exc.tenant, code)
    if exc.limit == "queue":  # the whole queue, nothing sheddable below: as without tenants
        return head_refusal.booked(RequestRejected(429, code, str(exc), type="rate_limit_error"))
    if exc.limit == "max_queue":
        message = f"tenant {exc.tenant!r} has {exc.value} requests waiting, its max_queue; retry later"
    else:
        message = f"tenant {exc.tenant!r} is in a sheddable band and the queue is full; retry later"
    rejection = RequestRejected(429, code, message, type="rate_limit_error")
    ceiling = admission.config.policy.queue_timeout
    service_time = service.front_door.shedder.service_time
    rejection.retry_after = tenant_retry_after(admission, exc.tenant, service_time, ceiling)
    return rejection

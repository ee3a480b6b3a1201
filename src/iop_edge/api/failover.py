"""Failover before the first byte: the Edge's loop around admission's retries.

A request runs as one or more *attempts*, each under its own lease. An attempt
that fails for a retryable reason before any byte reached the client raises
:class:`AttemptFailed`; the loop reports a provider failure to admission (when
it is one), lets the lease go, and asks admission for a retry of the same
request: another candidate, never one it tried, keeping the request's place in
arrival order and its queue deadline ([failover-before-first-byte]). When no
retry is possible -- ``retry.max_attempts`` reached, no other eligible
candidate, the queue deadline passed -- the last attempt's failure is the
answer. Admission decides everything about leases; this module only decides
*when to ask*, which is the HTTP layer's knowledge (did a byte go out?).

A run the node may have run is never retried: an attempt whose lease is revoked
while it holds it (its node's connection ended or was fenced) had sent its run
-- the Edge sends it as the lease is granted -- and nobody knows whether the
node ran it (a node stopped or cut off after its backend answered looks the same
as one that never started it), so ``LeaseRevoked`` is the answer. Refusing
beats running twice.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import final

from iop_admission import (
    Admission,
    Lease,
    LeaseRevoked,
    ModelNotFound,
    QueueTimeout,
    RetriesExhausted,
    Unavailable,
)

__all__ = ["RETRY_REASONS", "AttemptFailed", "serve_with_failover"]

#: Why an attempt is retried (the ``reason`` label of ``iop_retries_total``).
RETRY_REASONS = (
    "node_disconnected",
    "upstream_unreachable",
    "upstream_5xx",
    "upstream_429",
    "upstream_error",
    "concurrency_limit",
    "first_token_timeout",
)


@final
class AttemptFailed(Exception):
    """An attempt failed before any byte reached the client; another candidate may serve.

    Attributes:
        answer: what the client gets if no retry is possible.
        reason: one of :data:`RETRY_REASONS`.
        provider_failure: whether it counts against the provider ([outlier-ejection]);
            a node's ``concurrency_limit`` does not.
        lease: the lease of the attempt that failed (set by the loop).
    """

    def __init__(self, answer: Exception, reason: str, *, provider_failure: bool) -> None:
        super().__init__(reason)
        self.answer = answer
        self.reason = reason
        self.provider_failure = provider_failure
        self.lease: Lease | None = None


#: Admission's answers to a retry that mean "no retry": the last failure stands.
_NO_RETRY = (RetriesExhausted, Unavailable, QueueTimeout, ModelNotFound)


async def serve_with_failover(
    admission: Admission,
    model: str,
    long: bool,
    attempt: Callable[[Lease], Awaitable[str]],
    *,
    on_retry: Callable[[str, Lease], None],
    may_retry: Callable[[], bool] = lambda: True,
    tenant: str | None = None,
    cost: float = 1.0,
    tokens: int | None = None,
) -> str:
    """Run ``attempt(lease)`` under a lease, retrying on another candidate while it fails early.

    ``tenant`` and ``cost``: whom the request is charged to and its reserve ([tenant-edge]);
    ``tokens``: its context tokens on a token budget ([token-ledger]); a retry keeps all three
    (admission carries them).

    ``attempt`` raises :class:`AttemptFailed` only when nothing reached the
    client yet. A lease revoked under an attempt is never retried (its run was
    sent: the node may have run it). ``on_retry(reason, failed_lease)`` is called
    before each retry; an error it raises is the answer, and no retry is asked
    for (the Edge's: this Edge no longer leads [ha-step-down]). ``may_retry()`` False: the
    request's deadline leaves too little for another attempt ([deadline], ``min_attempt_ms``), and
    the last attempt's failure is the answer.

    Checkpoints (it waits for leases and runs attempts). Cancellation ends the
    current attempt and releases its lease; nothing is retried.

    Returns:
        The outcome of the attempt that served.

    Raises:
        AdmissionError: the first lease was refused (queue full, timeout, ...),
            or a lease was revoked under its attempt (``LeaseRevoked``: the node's
            connection ended or was fenced; its run may have run).
        Exception: the last attempt's ``answer`` when no retry is possible.
    """
    previous: Lease | None = None
    last: AttemptFailed | None = None
    while True:
        try:
            return await _attempt_once(admission, (model, long, tenant, cost, tokens), previous, last, attempt)
        except AttemptFailed as failed:
            previous, last = failed.lease, failed
        except _NO_RETRY:
            if last is None:
                raise
            raise last.answer from None
        assert previous is not None and last is not None
        if not may_retry():
            raise last.answer
        on_retry(last.reason, previous)


async def _attempt_once(
    admission: Admission,
    request: tuple[str, bool, str | None, float, int | None],
    previous: Lease | None,
    last: AttemptFailed | None,
    attempt: Callable[[Lease], Awaitable[str]],
) -> str:
    """One attempt under one lease: the first, or a retry of ``previous``.

    Checkpoints. Raises :class:`AttemptFailed` (with its lease, after the lease
    was released) for a failure that may be retried; ``LeaseRevoked`` as it is.
    """
    if previous is None:
        model, long, tenant, cost, tokens = request
        scope = admission.lease(model, long=long, tenant=tenant, cost=cost, tokens=tokens)
    else:
        assert last is not None
        scope = admission.retry(previous, reason=last.reason)
    held: Lease | None = None
    try:
        async with scope as lease:
            held = lease
            try:
                return await attempt(lease)
            except AttemptFailed as failed:
                failed.lease = lease
                if failed.provider_failure:
                    admission.report_failure(lease)
                raise
    except LeaseRevoked:
        if held is not None:  # the node went away under the run, which it may have run: not retried
            admission.report_failure(held)
        raise
    raise AssertionError("unreachable: a lease scope suppresses an error only to raise LeaseRevoked")

"""The Edge's part around one request's attempts: when to retry, what a failure becomes, how it is counted.

:func:`~iop_edge.api.failover.serve_with_failover` runs the attempts; these are the hooks the
API gives it ([failover-before-first-byte], [deadline], [error-classes]).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from iop_admission import Admission, AdmissionError, Lease, LeaseRevoked
from iop_edge.api.deadline import RequestDeadline
from iop_edge.api.failover import AttemptFailed, serve_with_failover
from iop_edge.api.not_leader import lost_unled, standby_refusal
from iop_edge.api.rejections import RequestRejected
from iop_edge.api.responder import Responder
from iop_edge.api.tenant_charge import Charge, refusal_of
from iop_edge.config import EdgeModel
from iop_edge.ha import EdgeHa
from iop_edge.metrics import EdgeMetrics

if TYPE_CHECKING:
    from iop_edge.api.app import EdgeParts
    from iop_edge.front_door.head_refusal import HeadRefusal

logger = logging.getLogger("iop_edge.http")


async def within_deadline(
    admission: Admission,
    request: tuple[str, bool, Charge],
    attempt: Callable[[Lease], Awaitable[str]],
    deadline: RequestDeadline,
    responder: Responder,
    hooks: tuple[EdgeMetrics, EdgeHa | None, EdgeModel | None],
) -> str:
    """A request's attempts (:func:`serve_with_failover`) within its deadline ([deadline]). Returns the outcome.

    ``request``: its model key, whether it is long, its tenant charge. ``hooks``: the Edge's
    metrics, its part in the election, the model's ``models[]`` entry (``min_attempt_ms``).

    Raises:
        RequestRejected: 504 ``deadline_exceeded`` once the deadline passed, or an attempt's failure.
        AdmissionError: as :func:`serve_with_failover`.
    """
    model, long, charge = request
    metrics, ha, entry = hooks
    min_attempt = 0.0 if entry is None else entry.min_attempt_ms / 1000
    outcome = "error"

    async def timed(lease: Lease) -> str:
        deadline.attempting, deadline.tried = True, (str(lease.provider), lease.attempt)
        try:
            return await attempt(lease)
        finally:
            if not deadline.scope.cancel_called:  # the deadline's answer says where it passed
                deadline.attempting = False

    with deadline.scope:
        outcome = await serve_with_failover(
            admission,
            model,
            long,
            timed,
            on_retry=retry_hook(metrics, ha, model, responder),
            may_retry=lambda: deadline_allows_retry(deadline, min_attempt, model),
            tenant=charge.tenant,
            cost=charge.cost,
            tokens=charge.context,
        )
    if deadline.scope.cancelled_caught:
        if deadline.answered is not None:  # answered at the deadline already (RequestDeadline.answer_now)
            raise deadline.answered
        if not responder.finished:
            raise deadline.exceeded(answered=responder.started)
    return outcome


def retry_hook(
    metrics: EdgeMetrics, ha: EdgeHa | None, model: str, responder: Responder
) -> Callable[[str, Lease], None]:
    """What to do before a retry ([failover-before-first-byte]): count it and say so -- unless this Edge
    has ``ha:`` and can no longer prove it leads [ha-step-down]: then the retry is not asked for, and
    the request is answered 503 (a woken leader whose runs' node dropped them): ``leader_stepped_down``
    when an attempt's run was sent (it may have run), else ``not_leader``."""

    def on_retry(reason: str, failed: Lease) -> None:
        if ha is not None and not ha.admits():
            raise standby_refusal(ha, ran=responder.run_sent)
        metrics.retried(model, reason)
        logger.info("retrying %s after %s on %s (attempt %d)", model, reason, failed.provider, failed.attempt)

    return on_retry


def deadline_allows_retry(deadline: RequestDeadline, min_attempt: float, model: str) -> bool:
    """Whether a failed attempt may be retried: ``min_attempt`` seconds of the request's deadline are left."""
    if deadline.may_retry(min_attempt):
        return True
    left = deadline.left()
    logger.info("not retrying %s: %.3f s of its deadline left, min_attempt_ms %g", model, left, min_attempt * 1000)
    return False


def count_failure(metrics: EdgeMetrics, model: str, rejection: RequestRejected) -> RequestRejected:
    """Count and log a request's failure by its class ([error-classes]); other refusals are counted
    elsewhere. Returns ``rejection``."""
    error_class = rejection.error_class
    if error_class is not None:
        metrics.request_failed(model, error_class)
        logger.info("request for %s failed: %s (%d): %s", model, error_class, rejection.status, rejection.message)
    return rejection


def count_cancelled(metrics: EdgeMetrics, model: str) -> None:
    """Count and log a request cancelled under way: its client went away (or this Edge stopped leading)."""
    metrics.request_failed(model, "cancelled")
    logger.info("request for %s cancelled: its client went away", model)


def attempt_failure(rejection: RequestRejected, lease: Lease, started: bool) -> Exception:
    """What an attempt's failure becomes: :class:`AttemptFailed` when another candidate may serve.

    Never for the client's error, never once a byte went out ([failover-before-first-byte]).
    """
    rejection.attempts = lease.attempt
    rejection.provider = str(lease.provider)  # the provider that was tried: x-iop-provider
    if rejection.retry is None or started:
        return rejection
    return AttemptFailed(rejection, rejection.retry, provider_failure=rejection.provider_failure)


def counted_failure(
    service: EdgeParts, head_refusal: HeadRefusal, model: str, failure: AdmissionError | RequestRejected
) -> tuple[RequestRejected, str]:
    """The client's answer to a request admission refused or its attempts lost, counted in the
    metrics; and the outcome its lease ends with (``revoked``, ``client_error`` or ``error``)."""
    metrics = service.metrics
    if isinstance(failure, AdmissionError):
        refusal = lost_unled(refusal_of(failure, service, head_refusal), service.ha)
        return count_failure(metrics, model, refusal), "revoked" if isinstance(failure, LeaseRevoked) else "error"
    rejection = lost_unled(failure, service.ha)
    outcome = "error"
    if rejection.code == "provider_busy":
        metrics.request_rejected(model, "provider_busy")
    elif rejection.reason == "upstream_client_error":
        outcome = "client_error"
    return count_failure(metrics, model, rejection), outcome

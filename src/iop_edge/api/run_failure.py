"""What a failed run becomes for the client: its status, code and whether another candidate may serve it."""

from __future__ import annotations

from iop_edge.api.rejections import RequestRejected, node_disconnected
from iop_edge.api.upstream_errors import upstream_error_object
from iop_wire import RunEnd

UPSTREAM_RETRY_AFTER = 1
"""``Retry-After`` seconds when a backend answered 429 (the node does not relay the backend's header), could
not be reached, or sent no first byte in time: a retry may find another candidate, or this one back."""
STALE_LEADER_RETRY_AFTER = 1
"""``Retry-After`` seconds when a node refused the run as ``stale_epoch``: a newer leader exists already."""


def run_failure(end: RunEnd) -> RequestRejected:
    """Map a node's ``run_end`` error to its HTTP answer, by its failure kind, and say
    whether it may be retried.

    A backend's client error (``client_error``: a 4xx but 401, 403, 407, 408 and
    429) keeps the backend's status and error object, is never retried and never
    counts against the provider; a backend 429 (``rate_limited``) is retried on
    another candidate and, if it ends the request, answered 429 with
    ``Retry-After`` and the backend's error object; the provider's failures
    (unreachable, 5xx, 401/403/407/408, an unreadable answer) are
    retried and count against it, and end as ``502 upstream_error``; the node's
    ``concurrency_limit`` is retried but does not count; a ``bad_request`` from
    the node is never retried. ``x-iop-provider`` is set by the caller.
    """
    detail = end.message or end.code or "run failed"
    if (refused := _node_refusal(end, detail)) is not None:
        return refused
    if (timed := _deadline_or_stall(end, detail)) is not None:
        return timed
    if end.upstream_status is not None and end.failure in ("client_error", "rate_limited"):
        return _upstream_answer(end, end.upstream_status, detail)
    return _provider_failure(end, detail)


def _node_refusal(end: RunEnd, detail: str) -> RequestRejected | None:
    """The answer to a run the node itself refused or cut (busy, cancelled, a stale leader), else None."""
    kind = end.failure
    if kind == "node_busy":
        return RequestRejected(
            503,
            "provider_busy",
            f"provider busy: {detail}",
            type="service_unavailable",
            reason="provider_busy",
            retry="concurrency_limit",
        )
    if kind == "cancelled":
        return node_disconnected(f"run cancelled by the node: {detail}")
    if kind == "stale_leader":  # [epoch-fencing] a newer leader exists: never retried here
        return RequestRejected(
            503,
            "not_leader",
            f"this Edge no longer leads: {detail}",
            type="service_unavailable",
            retry_after=STALE_LEADER_RETRY_AFTER,
        )
    return None


def _upstream_answer(end: RunEnd, status: int, detail: str) -> RequestRejected:
    """A backend's 4xx answer passed on: its status and error object (a 429 is retried, a client error not)."""
    rate_limited = end.failure == "rate_limited"
    retry = upstream_retry(end)
    error = upstream_error_object(status, end.upstream_body, detail)
    return RequestRejected(
        status,
        str(error["code"] or ""),
        str(error["message"]),
        type=str(error["type"]),
        reason="upstream_rate_limited" if rate_limited else "upstream_client_error",
        retry_after=UPSTREAM_RETRY_AFTER if rate_limited else None,
        retry=retry,
        provider_failure=retry is not None,
        error=error,
    )


def _provider_failure(end: RunEnd, detail: str) -> RequestRejected:
    """Any other failure: ``502 upstream_error`` (retried and counted when it is the provider's)."""
    if end.upstream_status is not None:
        detail = f"upstream answered {end.upstream_status}: {detail}"
    retry = upstream_retry(end)
    return RequestRejected(
        502,
        "upstream_too_large" if end.code == "upstream_too_large" else "upstream_error",
        detail,
        type="upstream_error",
        reason=end.code or "upstream_error",
        retry_after=UPSTREAM_RETRY_AFTER if end.failure == "unreachable" else None,
        retry=retry,
        provider_failure=retry is not None,
    )


def _deadline_or_stall(end: RunEnd, detail: str) -> RequestRejected | None:
    """The answer to a run the node ended ``deadline_exceeded`` or ``stream_stalled`` (wire v6), else None."""
    if end.code == "deadline_exceeded":  # [deadline] wire v6: the node bounded the backend call by it
        return RequestRejected(
            504, "deadline_exceeded", f"the request's deadline passed at the node: {detail}", type="timeout_error"
        )
    if end.code == "stream_stalled":  # wire v6: the provider's failure, after its first bytes
        return RequestRejected(
            502,
            "stream_stalled",
            f"the upstream stopped sending mid-answer: {detail}",
            type="upstream_error",
            retry="upstream_error",
            provider_failure=True,
        )
    return None


def upstream_retry(end: RunEnd) -> str | None:
    """The retry reason of a failed run (``iop_wire.failure_kind``), or None when the failure is not the provider's."""
    kind = end.failure
    if kind == "unreachable":
        return "upstream_unreachable"
    if kind == "rate_limited":
        return "upstream_429"
    if kind == "provider_error":
        status = end.upstream_status
        return "upstream_5xx" if status is not None and status >= 500 else "upstream_error"
    return None  # client_error, node_refused: the run cannot be served as asked

"""The Edge's error answers in the OpenAI shape: :class:`RequestRejected` and its encoding.

A refusal is a JSON body ``{"error": {message, type, code}}`` with an
``x-iop-reject-reason`` header; the Edge's own refusals that repeat under a
flood (a ``Retry-After`` and nothing request-specific) are encoded once per
kind (:func:`canned`).
"""

from __future__ import annotations

import json
from typing import Any

from iop_admission import (
    AdmissionError,
    LeaseRevoked,
    ModelNotFound,
    QueueFull,
    QueueTimeout,
    Unavailable,
)
from iop_edge.ha import LEADER_HEADER
from iop_edge.listener.pacing import Headers

JSON = (b"content-type", b"application/json")
"""The ``content-type`` header of a JSON answer."""

ERROR_CLASSES = (
    "queue_timeout",
    "deadline_exceeded",
    "first_token_timeout",
    "stream_stalled",
    "upstream_unreachable",
    "upstream_error",
    "cancelled",
)
"""[error-classes] What became of a request that failed, in the words of its ``x-iop-error-class``
header, the ``class`` label of ``iop_request_failures_total``, ``/status`` and the logs
(``docs/openai-api.md``, Error classes). ``cancelled``: the client went away (nothing is answered)."""
_CLASS_OF_CODE = {name: name for name in ERROR_CLASSES[:4]}


class RequestRejected(Exception):
    """An error answer in the OpenAI shape (status, type, code, message)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        type: str = "invalid_request_error",
        reason: str | None = None,
        retry_after: int | None = None,
        retry: str | None = None,
        provider_failure: bool = False,
        error: dict[str, Any] | None = None,
        provider: str | None = None,
        leader: str | None = None,
    ) -> None:
        super().__init__(message)
        self.read_after: float | None = None  # trio time before which the connection is not read again (pacing)
        self.status = status
        self.code = code
        self.message = message
        self.type = type
        self.reason = reason or code
        self.retry_after = retry_after
        self.retry = retry  # a retry reason when another candidate may serve (before the first byte)
        self.provider_failure = provider_failure  # counts against the provider ([outlier-ejection])
        self.attempts: int | None = None  # attempts made, when it ends a run
        self.error = error  # a backend's own error object, passed through instead of ours
        self.provider = provider
        self.leader = leader  # a standby's refusal names the leading Edge ([ha-election])

    @property
    def error_class(self) -> str | None:
        """Its class (one of :data:`ERROR_CLASSES`), or None for a refusal that is none of them
        (the client's mistake, a full queue, an overload, a standby: their ``code`` says it)."""
        named = _CLASS_OF_CODE.get(self.code)
        if named is not None:
            return named
        if self.reason == "upstream_unreachable":
            return "upstream_unreachable"
        if self.type == "upstream_error" and self.code != "client_too_slow":
            return "upstream_error"
        return None

    def body(self) -> bytes:
        error = self.error or {"message": self.message, "type": self.type, "code": self.code}
        return dumps({"error": error})

    def headers(self) -> list[tuple[bytes, bytes]]:
        headers = [JSON, (b"x-iop-reject-reason", self.reason.encode())]
        error_class = self.error_class
        if error_class is not None:
            headers.append((b"x-iop-error-class", error_class.encode()))
        if self.retry_after is not None:
            headers.append((b"retry-after", str(self.retry_after).encode()))
        if self.attempts is not None:
            headers.append((b"x-iop-attempts", str(self.attempts).encode()))
        if self.provider is not None:
            headers.append((b"x-iop-provider", self.provider.encode()))
        if self.leader is not None:
            headers.append((LEADER_HEADER.encode(), self.leader.encode()))
        return headers


_CANNED: dict[tuple[object, ...], tuple[list[tuple[bytes, bytes]], bytes]] = {}
CANNED_MAX = 256


def canned(rejection: RequestRejected) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The response head (with its content-length) and body of ``rejection``, built once per kind.

    Refusals under a flood repeat (``queue_full`` with the same Retry-After thousands of times a
    second): each distinct one is encoded once. Only the Edge's own refusals with a Retry-After
    are kept (``queue_full``, ``queue_timeout``, ``overloaded``: no backend error object, no
    attempt count or provider), the first ``CANNED_MAX`` distinct ones.
    """
    key = (
        rejection.status,
        rejection.code,
        rejection.reason,
        rejection.type,
        rejection.message,
        rejection.retry_after,
        rejection.leader,
    )
    canned = _CANNED.get(key)
    if canned is None:
        body = rejection.body()
        canned = ([*rejection.headers(), (b"content-length", b"%d" % len(body))], body)
        own = rejection.error is None and rejection.attempts is None and rejection.provider is None
        if own and rejection.retry_after is not None and len(_CANNED) < CANNED_MAX:
            _CANNED[key] = canned
    return canned


def dumps(value: object) -> bytes:
    """``value`` as compact JSON in UTF-8; a string that is not text (a lone surrogate a peer sent)
    is written as its ``\\u`` escape, so an answer is always writable."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":")).encode()


def bearer(headers: Headers) -> str | None:
    """The token of the ``Authorization: Bearer`` header, or None.

    Only SP and HTAB around it are removed (RFC 9110 §5.5, optional whitespace): any other
    character, ``\\xa0`` or ``\\x85`` included, is part of the token and must match.
    """
    for name, value in headers:
        if name == b"authorization":
            text: str = value.decode("latin-1")
            if text[:7].lower() == "bearer ":
                return text[7:].strip(OWS)
            return None
    return None


OWS = " \t"
"""Optional whitespace of an HTTP field value (RFC 9110 §5.6.3): SP and HTAB, nothing else."""


def admission_rejection(exc: AdmissionError) -> RequestRejected:
    """Map an admission outcome to its HTTP answer (the queue's refusals get their Retry-After later)."""
    if isinstance(exc, ModelNotFound):
        return RequestRejected(404, "model_not_found", str(exc))
    if isinstance(exc, QueueFull):
        return RequestRejected(429, "queue_full", str(exc), type="rate_limit_error")
    if isinstance(exc, QueueTimeout):
        return RequestRejected(429, "queue_timeout", str(exc), type="rate_limit_error")
    if isinstance(exc, Unavailable):
        return RequestRejected(503, "unavailable", str(exc), type="service_unavailable")
    if isinstance(exc, LeaseRevoked):
        return node_disconnected(str(exc))
    return RequestRejected(500, "internal_error", str(exc), type="server_error")


def node_disconnected(message: str, *, sent: bool = True) -> RequestRejected:
    """The node's connection ended (or the node cancelled the run).

    ``sent``: the run's frame had left for the node, which may have run it -- its fate is
    unknown (the node may be stopped, cut off, or have run it to its end before it went
    silent), so it is not retried elsewhere: refusing beats running twice
    ([failover-before-first-byte]). A run that never left (the connection was gone before it
    was sent) may be retried on another candidate.
    """
    return RequestRejected(
        502,
        "node_disconnected",
        message,
        type="upstream_error",
        retry=None if sent else "node_disconnected",
        provider_failure=True,
    )

"""Errors of the Node daemon, each named for what happened.

A run fails with one :class:`RunFailed` subclass; its ``code`` is the wire
error code the session puts into ``run_end`` / ``tunnel_end`` (one mapping, in
one place). Registration outcomes are separate: they end a connection, not a run.
"""

from __future__ import annotations

from typing import ClassVar, final


class NodeError(Exception):
    """Base class of every error :mod:`iop_node` raises on purpose."""


class RunFailed(NodeError):
    """A run or tunnel request failed; ``code`` is its wire error code."""

    code: ClassVar[str]

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


@final
class BadRunRequest(RunFailed):
    """The run cannot be served as asked (unknown provider, endpoint or path)."""

    code = "bad_request"


@final
class StaleEpoch(RunFailed):
    """[epoch-fencing] The run carries an older leader epoch than the node has seen (docs/wire.md, Epoch fencing)."""

    code = "stale_epoch"


@final
class UpstreamUnreachable(RunFailed):
    """The upstream could not be reached, timed out, or dropped the connection.

    ``silent``: it was a read timeout (the upstream sent nothing for the provider's ``timeout_ms``);
    after part of an answer went to the Edge that is a :class:`StreamStalled`.
    """

    code = "upstream_unreachable"

    def __init__(self, message: str, *, silent: bool = False) -> None:
        super().__init__(message)
        self.silent = silent


@final
class StreamStalled(RunFailed):
    """[error-classes] The upstream sent part of its answer, then nothing for the provider's ``timeout_ms``."""

    code = "stream_stalled"


@final
class DeadlineExceeded(RunFailed):
    """[deadline] The run's deadline (wire v6 ``run.deadline_ms``) passed first; its upstream request was closed."""

    code = "deadline_exceeded"


@final
class UpstreamTooLarge(RunFailed):
    """The upstream's answer head, a non-stream answer, or a line of a stream is larger than its bound.

    The bounds are the provider's ``limits`` (:class:`iop_node.config.UpstreamLimits`).
    """

    code = "upstream_too_large"


@final
class UpstreamFailed(RunFailed):
    """The upstream answered with a non-2xx status or an unreadable body.

    The Edge tells the client's mistakes from the provider's by ``status``
    (``iop_wire.failure_kind``): a backend 4xx reaches the client with its status
    and ``body``.

    Attributes:
        status: the upstream's HTTP status, or None when the status was 2xx
            but the body could not be understood.
        body: the upstream's error body as text (at most
            ``iop_wire.UPSTREAM_BODY_LIMIT`` characters), or None.
    """

    code = "upstream_error"

    def __init__(self, message: str, status: int | None = None, body: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


@final
class RegistrationRejected(NodeError):
    """The Edge answered ``rejected``.

    Attributes:
        code: the reject code (``bad_token``, ``protocol_mismatch``, ...).
        reason: the Edge's human-readable reason.
        retryable: whether reconnecting later may succeed.
    """

    def __init__(self, code: str, reason: str, retryable: bool) -> None:
        self.code = code
        self.reason = reason
        self.retryable = retryable
        super().__init__(f"registration rejected: {code}: {reason}")


@final
class RegistrationTimeout(NodeError):
    """The Edge did not answer ``register`` in time."""


@final
class EdgeProtocolViolation(NodeError):
    """The Edge sent something the protocol does not allow; the node closed the socket."""

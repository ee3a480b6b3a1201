"""Errors raised by :mod:`iop_admission`.

Every class derives from :class:`AdmissionError` and is named for what happened.
HTTP status codes belong to the Edge's mapping, not to this library.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import final


class AdmissionError(Exception):
    """Base class of every error this library raises on purpose."""


@final
class ConfigError(AdmissionError, ValueError):
    """The configuration is invalid; ``problems`` lists every problem found.

    Raised when a :class:`ProviderSpec` or :class:`QueuePolicy` is constructed
    with bad values, by :class:`Admission` and by :meth:`Admission.refresh`.
    """

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems: tuple[str, ...] = tuple(problems)
        super().__init__("; ".join(self.problems) or "invalid configuration")


@final
class ModelNotFound(AdmissionError, LookupError):
    """The model key is not configured (or was removed by a refresh while waiting)."""

    def __init__(self, model: str) -> None:
        self.model = model
        super().__init__(f"model {model!r} is not configured")


@final
class QueueFull(AdmissionError):
    """The Edge-wide wait queue already holds ``max_queue`` waiters."""

    def __init__(self, model: str, max_queue: int) -> None:
        self.model = model
        self.max_queue = max_queue
        super().__init__(f"queue full ({max_queue} waiting); model {model!r}")


@final
class QueueTimeout(AdmissionError):
    """The waiter was not granted a provider before its queue deadline."""

    def __init__(self, model: str, waited: float) -> None:
        self.model = model
        self.waited = waited
        super().__init__(f"queue timeout after {waited:.3f}s; model {model!r}")


@final
class Unavailable(AdmissionError):
    """No candidate of the model is eligible (offline, disabled, or unable to run it).

    ``reasons`` says, for a request refused on arrival, why each candidate is
    not eligible (``"node-a/gpu0: node 'node-a' is not connected"``).
    """

    def __init__(self, model: str, long: bool = False, reasons: tuple[str, ...] = ()) -> None:
        self.model = model
        self.long = long
        self.reasons = reasons  # one "provider: why it is not eligible" per candidate, in candidate order
        kind = "long request" if long else "request"
        why = "".join(f"; {r}" for r in reasons)
        super().__init__(f"no eligible provider for {kind} on model {model!r}{why}")


@final
class LeaseRevoked(AdmissionError):
    """The lease's node generation was fenced (disconnect or reconnect) while it ran."""

    def __init__(self, lease_id: int, node_id: str, generation: int) -> None:
        self.lease_id = lease_id
        self.node_id = node_id
        self.generation = generation
        super().__init__(f"lease {lease_id} revoked: node {node_id!r} generation {generation} was fenced")


@final
class ConcurrencyLimitExceeded(AdmissionError):
    """A :class:`LocalGate` had no free permit; the caller is rejected at once."""

    def __init__(self, name: str, scope: str, limit: int) -> None:
        self.name = name
        self.scope = scope  # "provider" or "global"
        self.limit = limit
        super().__init__(f"concurrency limit reached for {name!r} ({scope} limit {limit})")


@final
class RetriesExhausted(AdmissionError):
    """A retry was asked for a request that already made ``retry.max_attempts`` attempts."""

    def __init__(self, model: str, attempts: int) -> None:
        self.model = model
        self.attempts = attempts
        super().__init__(f"no retry left for model {model!r} after {attempts} attempts")


class LeaseScopeError(AdmissionError, RuntimeError):
    """A lease scope was misused: entered twice, exited twice, or exited without being entered.

    A ``RuntimeError`` too, as the scope raised before it had a name of its own.
    """


@final
class NodeNotFound(AdmissionError, LookupError):
    """``connect()`` named a node that no configuration had a provider on (a typo, or a node not in the config)."""

    def __init__(self, node_id: str, known: tuple[str, ...]) -> None:
        self.node_id = node_id
        shown = ", ".join(repr(n) for n in known[:10]) + (", ..." if len(known) > 10 else "")
        super().__init__(f"node {node_id!r} has no configured provider; nodes with providers: {shown or 'none'}")


@final
class TenantLimitExceeded(AdmissionError):
    """A tenant's own quota refused the request; ``limit`` names which one.

    ``limit`` is ``"max_queue"`` (the tenant's part of the queue is full),
    ``"shed"`` (a negative-priority waiter refused or evicted under overload)
    or ``"queue"`` (the whole queue is full and nothing sheddable is below).
    """

    def __init__(self, tenant: str, limit: str, value: int) -> None:
        super().__init__(f"tenant {tenant!r}: {limit} ({value}) reached")
        self.tenant = tenant
        self.limit = limit
        self.value = value

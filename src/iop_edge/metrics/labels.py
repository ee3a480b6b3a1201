"""The closed label sets of the Edge's metrics (``docs/metrics.md``), the check of a value against one, and
:class:`ClosedCounter`, a counter by one such label."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Literal, final, get_args

from prometheus_client import CollectorRegistry, Counter

#: ``reason`` label values of ``iop_rejected_total``.
REJECTION_REASONS: Final = frozenset(
    {"queue_full", "queue_timeout", "unavailable", "model_not_found", "provider_busy", "overloaded"}
)
#: ``outcome`` label values of ``iop_lease_endings_total``.
LEASE_OUTCOMES: Final = ("ok", "error", "client_error", "cancelled", "revoked")
#: ``cause`` label values of ``iop_node_disconnects_total``.
DisconnectCause = Literal["graceful", "heartbeat_timeout", "error"]
"""Why a node connection ended: ``graceful`` (close 1000/1001), ``heartbeat_timeout``, ``error``."""
DISCONNECT_CAUSES: Final = frozenset(get_args(DisconnectCause))
#: ``result`` label values of ``iop_config_refreshes_total``.
REFRESH_RESULTS: Final = ("ok", "rejected")
#: ``reason`` label values of ``iop_node_pending_closed_total``.
PENDING_CLOSE_REASONS: Final = ("max_pending", "max_pending_per_source", "handshake_timeout", "tls_handshake")
#: ``address_class`` label values of ``iop_node_registration_failures_total``.
ADDRESS_CLASSES: Final = frozenset({"loopback", "private", "public", "unknown"})

#: Admission error class names (``AdmissionEvent.reason``) to ``reason`` codes.
REASON_CODES: Final = {
    "QueueFull": "queue_full",
    "QueueTimeout": "queue_timeout",
    "Unavailable": "unavailable",
    "ModelNotFound": "model_not_found",
    "TenantLimitExceeded": "tenant_limit",
}


def check_label(value: str, allowed: Iterable[str], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(sorted(allowed))}")


@final
class ClosedCounter:
    """A counter by one label of a closed set: every series made at 0 from the start, so rate() and
    absence alerts work from the first scrape, and each kept (``labels()`` is looked up once).

    Args:
        registry: the Edge's registry the counter is registered in.
        name, documentation: the counter's.
        label: the label's name and its values.
        what: the label's meaning, for :func:`check_label`'s message.
    """

    __slots__ = ("_children", "_what")

    def __init__(
        self, registry: CollectorRegistry, name: str, documentation: str, label: tuple[str, Iterable[str]], what: str
    ) -> None:
        counter = Counter(name, documentation, (label[0],), registry=registry)
        self._children = {value: counter.labels(value) for value in label[1]}
        self._what = what

    def count(self, value: str) -> None:
        """Count one ``value``.

        Raises:
            ValueError: ``value`` is not one of the label's values.
        """
        check_label(value, self._children, self._what)
        self._children[value].inc()

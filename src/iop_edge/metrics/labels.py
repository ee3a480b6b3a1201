"""The closed label sets of the Edge's metrics (``docs/metrics.md``), and the check of a value against one."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Literal, get_args

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

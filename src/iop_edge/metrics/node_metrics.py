"""The node socket's family of the Edge's metrics: :class:`NodeMetrics`, counted by the node registry's hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import final

from prometheus_client import CollectorRegistry, Counter, Gauge

from iop_edge.metrics.labels import (
    ADDRESS_CLASSES,
    DISCONNECT_CAUSES,
    PENDING_CLOSE_REASONS,
    ClosedCounter,
    DisconnectCause,
    check_label,
)


@final
class NodeMetrics:
    """The nodes' comings and goings: registrations, disconnects and the connections that never registered.

    Args:
        registry: the Edge's registry the metrics are registered in.
        per_node: False counts ``iop_node_connects_total`` and
            ``iop_node_disconnects_total`` with ``node=""``, so the series count
            does not grow with the fleet.
    """

    def __init__(self, registry: CollectorRegistry, *, per_node: bool) -> None:
        self._per_node = per_node
        self._connects = Counter("iop_node_connects", "Accepted node registrations.", ("node",), registry=registry)
        self._disconnects = Counter(
            "iop_node_disconnects",
            "Authoritative node disconnects, by cause.",
            ("node", "cause"),
            registry=registry,
        )
        self._pending = Gauge(
            "iop_node_pending_connections",
            "Connections to the node socket between accept and registration.",
            registry=registry,
        )
        self._pending_closed = ClosedCounter(
            registry,
            "iop_node_pending_closed",
            "Unregistered node-socket connections the Edge closed, by reason "
            "(a pending cap was reached at accept, or the handshake deadline passed).",
            ("reason", PENDING_CLOSE_REASONS),
            "pending close reason",
        )
        self._registration_failures = Counter(
            "iop_node_registration_failures",
            "Rejected node registrations, by reject code and class of source address.",
            ("reason", "address_class"),
            registry=registry,
        )

    def _node_label(self, node_id: str) -> str:
        """``node_id``, or ``""`` where series are Edge-wide (``per_node`` False)."""
        return node_id if self._per_node else ""

    def node_connected(self, node_id: str) -> None:
        """Count an accepted registration of ``node_id``."""
        self._connects.labels(self._node_label(node_id)).inc()

    def node_disconnected(self, node_id: str, cause: DisconnectCause) -> None:
        """Count an authoritative disconnect of ``node_id`` (not a stale or rejected one).

        Raises:
            ValueError: ``cause`` is not one of :data:`DISCONNECT_CAUSES`.
        """
        check_label(cause, DISCONNECT_CAUSES, "disconnect cause")
        self._disconnects.labels(self._node_label(node_id), cause).inc()

    def follow_node_socket(self, pending: Callable[[], int]) -> None:
        """Read ``iop_node_pending_connections`` from ``pending()`` at every scrape."""
        self._pending.set_function(pending)

    def node_pending_closed(self, reason: str) -> None:
        """Count an unregistered node-socket connection the Edge closed.

        Raises:
            ValueError: ``reason`` is not one of :data:`PENDING_CLOSE_REASONS`.
        """
        self._pending_closed.count(reason)

    def node_registration_rejected(self, code: str, address_class: str) -> None:
        """Count a rejected registration (``bad_token``, ``unknown_node``, ...) from a class of address.

        Raises:
            ValueError: ``address_class`` is not one of :data:`ADDRESS_CLASSES`.
        """
        check_label(address_class, ADDRESS_CLASSES, "address class")
        self._registration_failures.labels(code, address_class).inc()

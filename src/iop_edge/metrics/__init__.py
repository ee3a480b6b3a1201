"""Prometheus metrics of one Edge: ``GET /metrics``.

Three sources, each with its own honesty rule (documented in ``docs/metrics.md``):

* **Gauges are read, never kept.** Per-provider and Edge-wide gauges are
  computed at scrape time from :meth:`Admission.snapshot` by a custom
  collector, so they are the numbers admission itself uses and cannot drift.
* **Event counters are best effort.** ``iop_admitted_total``, most of
  ``iop_rejected_total`` and ``iop_queue_wait_seconds`` are fed by
  :meth:`Admission.subscribe`. A subscriber that falls behind loses events;
  they then undercount, and ``iop_events_dropped_total`` (from the snapshot)
  shows that it happened. Nothing in admission ever reads a metric.
* **Hook counters are exact.** What admission events cannot see (API-level
  rejections, lease outcomes, node connection causes, config refreshes,
  retries) the Edge reports through the explicit methods of :class:`EdgeMetrics`.

Every :class:`EdgeMetrics` has its own :class:`~prometheus_client.CollectorRegistry`
(never the process-global default), so several Edges or tests can coexist in
one process.

:mod:`.labels` holds the closed label sets, :mod:`.collectors` the scrape-time collectors,
:mod:`.request_metrics` the requests' counters (:class:`RequestMetrics`), :mod:`.node_metrics` the
node socket's (:class:`NodeMetrics`), :mod:`.edge_metrics` the :class:`EdgeMetrics` object that
composes them with the registry and the scrape.
"""

from iop_edge.api.failover import RETRY_REASONS
from iop_edge.metrics.edge_metrics import EdgeMetrics
from iop_edge.metrics.labels import (
    ADDRESS_CLASSES,
    DISCONNECT_CAUSES,
    LEASE_OUTCOMES,
    PENDING_CLOSE_REASONS,
    REFRESH_RESULTS,
    REJECTION_REASONS,
    DisconnectCause,
)
from iop_edge.metrics.node_metrics import NodeMetrics
from iop_edge.metrics.request_metrics import RequestMetrics

__all__ = [
    "ADDRESS_CLASSES",
    "DISCONNECT_CAUSES",
    "LEASE_OUTCOMES",
    "PENDING_CLOSE_REASONS",
    "REFRESH_RESULTS",
    "REJECTION_REASONS",
    "RETRY_REASONS",
    "DisconnectCause",
    "EdgeMetrics",
    "NodeMetrics",
    "RequestMetrics",
]

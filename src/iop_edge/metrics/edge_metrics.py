"""The Edge's metrics object: :class:`EdgeMetrics`, its registry and scrape, composed of one part a family."""

from __future__ import annotations

from collections.abc import Callable
from typing import final

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from iop_admission import Admission
from iop_edge._off_loop import run_off_loop, snapshot_in_slices
from iop_edge.metrics.collectors import READING, FrontDoorCollector, Level, Reading, SnapshotCollector
from iop_edge.metrics.labels import REFRESH_RESULTS, ClosedCounter, DisconnectCause
from iop_edge.metrics.node_metrics import NodeMetrics
from iop_edge.metrics.request_metrics import RequestMetrics
from iop_edge.status import OverloadStatus


@final
class EdgeMetrics:
    """The Edge's Prometheus metrics: scrape-time gauges, event counters and hook counters.

    The requests' counters are :attr:`requests` (:class:`RequestMetrics`), the
    node socket's :attr:`nodes` (:class:`NodeMetrics`); this object keeps the
    registry, the readings taken at scrape time and the config refreshes, and
    offers every hook under its own name.

    Args:
        admission: the Edge's admission; read by snapshot at scrape time and
            followed by :meth:`run`. Metrics never feed back into it.
        per_provider: False aggregates the per-provider gauges per node (label
            ``node`` only) and counts ``iop_admitted_total`` with ``provider=""``:
            the series count then grows with nodes, not providers.
        per_node: False (implies ``per_provider`` False) sums them over the
            whole Edge (no label; ``iop_generation`` left out) and counts
            ``iop_admitted_total``, ``iop_node_connects_total`` and
            ``iop_node_disconnects_total`` with ``node=""``: the series count
            then does not grow with the fleet at all.
    """

    def __init__(self, admission: Admission, *, per_provider: bool = True, per_node: bool = True) -> None:
        self._admission = admission
        self.registry = CollectorRegistry()
        level: Level = "edge" if not per_node else "provider" if per_provider else "node"
        self.registry.register(SnapshotCollector(admission, level))
        self._front_door: Callable[[], OverloadStatus] | None = None
        self.requests = RequestMetrics(admission, self.registry, level)
        self.nodes = NodeMetrics(self.registry, per_node=per_node)
        self._answer_bytes_held = Gauge(
            "iop_answer_bytes_held",
            "Bytes of non-stream answers the Edge holds until they are written to their clients (bounded by answer_budget_bytes).",
            registry=self.registry,
        )
        self._refreshes = ClosedCounter(
            self.registry,
            "iop_config_refreshes",
            "Live config refreshes, by result.",
            ("result", REFRESH_RESULTS),
            "refresh result",
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """:meth:`RequestMetrics.run`: follow admission events and count them, until cancelled."""
        await self.requests.run(task_status=task_status)

    # ------------------------------------------------------------------ hooks

    def request_rejected(self, model: str, reason: str) -> None:
        """:meth:`RequestMetrics.request_rejected`."""
        self.requests.request_rejected(model, reason)

    def rejection_counter(self, model: str, reason: str) -> Callable[[], None]:
        """:meth:`RequestMetrics.rejection_counter`."""
        return self.requests.rejection_counter(model, reason)

    def tenant_rejected(self, tenant: str, code: str) -> None:
        """:meth:`RequestMetrics.tenant_rejected`."""
        self.requests.tenant_rejected(tenant, code)

    def lease_ended(self, model: str, outcome: str, duration: float) -> None:
        """:meth:`RequestMetrics.lease_ended`."""
        self.requests.lease_ended(model, outcome, duration)

    def request_failed(self, model: str, error_class: str) -> None:
        """:meth:`RequestMetrics.request_failed`."""
        self.requests.request_failed(model, error_class)

    @property
    def failures(self) -> dict[str, dict[str, int]]:
        """:attr:`RequestMetrics.failures`: failed requests by model and error class (``/status``'s ``failures``)."""
        return self.requests.failures

    def retried(self, model: str, reason: str) -> None:
        """:meth:`RequestMetrics.retried`."""
        self.requests.retried(model, reason)

    def node_connected(self, node_id: str) -> None:
        """:meth:`NodeMetrics.node_connected`."""
        self.nodes.node_connected(node_id)

    def node_disconnected(self, node_id: str, cause: DisconnectCause) -> None:
        """:meth:`NodeMetrics.node_disconnected`."""
        self.nodes.node_disconnected(node_id, cause)

    def node_pending_closed(self, reason: str) -> None:
        """:meth:`NodeMetrics.node_pending_closed`."""
        self.nodes.node_pending_closed(reason)

    def node_registration_rejected(self, code: str, address_class: str) -> None:
        """:meth:`NodeMetrics.node_registration_rejected`."""
        self.nodes.node_registration_rejected(code, address_class)

    def follow_node_socket(self, pending: Callable[[], int]) -> None:
        """:meth:`NodeMetrics.follow_node_socket`."""
        self.nodes.follow_node_socket(pending)

    def follow_front_door(self, read: Callable[[], OverloadStatus]) -> None:
        """Read the overload gauges from ``read()`` (``FrontDoor.status``) at every scrape."""
        self._front_door = read
        self.registry.register(FrontDoorCollector(read))

    def follow_answers(self, held: Callable[[], int]) -> None:
        """Read ``iop_answer_bytes_held`` from ``held()`` at every scrape."""
        self._answer_bytes_held.set_function(held)

    def refresh_result(self, result: str) -> None:
        """Count a config refresh: ``ok`` (applied) or ``rejected`` (old config kept).

        Raises:
            ValueError: ``result`` is not one of :data:`REFRESH_RESULTS`.
        """
        self._refreshes.count(result)

    # ---------------------------------------------------------------- scrape

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every metric, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def render_off_loop(self) -> tuple[bytes, str]:
        """:meth:`render`, with the text written in a worker thread ([status-at-size]).

        The admission snapshot is read on the loop a slice at a time
        (:func:`snapshot_in_slices`), the front door's figures at once; turning
        them and the counters into text (long at fleet size) runs off the loop, so streams keep flowing
        meanwhile. Checkpoints.
        """
        snapshot = await snapshot_in_slices(self._admission)
        front_door = self._front_door() if self._front_door is not None else None
        reading = Reading(snapshot, tuple(self._admission.config.models), front_door)
        token = READING.set(reading)  # the worker thread runs in a copy of this context
        try:
            return await run_off_loop(self.render)
        finally:
            READING.reset(token)

    def __repr__(self) -> str:
        return f"<EdgeMetrics of {self._admission!r}>"

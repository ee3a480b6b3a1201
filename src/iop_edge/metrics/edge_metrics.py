"""The Edge's metrics object: :class:`EdgeMetrics`, its registry, event counters and hook counters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Generic, TypeVar, final

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from iop_admission import Admission, AdmissionEvent
from iop_edge._off_loop import run_off_loop, snapshot_in_slices
from iop_edge.api.failover import RETRY_REASONS
from iop_edge.api.rejections import ERROR_CLASSES
from iop_edge.metrics.collectors import READING, FrontDoorCollector, Level, Reading, SnapshotCollector
from iop_edge.metrics.labels import (
    ADDRESS_CLASSES,
    DISCONNECT_CAUSES,
    LEASE_OUTCOMES,
    PENDING_CLOSE_REASONS,
    REASON_CODES,
    REFRESH_RESULTS,
    REJECTION_REASONS,
    DisconnectCause,
    check_label,
)
from iop_edge.status import OverloadStatus

#: The queue timeout defaults to 30 s; waits beyond a minute are off the scale anyway.
_QUEUE_WAIT_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: LLM requests run from well under a second to many minutes (long streamed generations).
_REQUEST_DURATION_BUCKETS: Final = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


_Metric = TypeVar("_Metric", Counter, Histogram)


UNKNOWN_MODEL = "unknown_model"
"""The ``model`` label of a refusal for a name that is no configured model key."""


@final
class _Series(Generic[_Metric]):
    """The children of one labelled metric, each looked up through ``labels()`` once.

    ``labels()`` converts and checks the label values and takes the metric's
    lock on every call, several times on every admitted request's path. A child never changes once made (nothing here removes
    one), so each is kept by its label values.
    """

    __slots__ = ("_labels", "_children")

    def __init__(self, metric: _Metric) -> None:
        self._labels: Callable[..., _Metric] = metric.labels
        self._children: dict[tuple[str, ...], _Metric] = {}

    def __call__(self, *values: str) -> _Metric:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._labels(*values)
        return child


@final
class _Failures:
    """``iop_request_failures_total`` ([error-classes]), and the same counts kept for ``/status``."""

    __slots__ = ("_counter", "by_model")

    def __init__(self, registry: CollectorRegistry) -> None:
        self._counter = Counter(
            "iop_request_failures",
            "Requests that failed, by model and error class (docs/openai-api.md, Error classes).",
            ("model", "class"),
            registry=registry,
        )
        self.by_model: dict[str, dict[str, int]] = {}

    def count(self, model: str, error_class: str) -> None:
        check_label(error_class, ERROR_CLASSES, "error class")
        self._counter.labels(model, error_class).inc()
        by_class = self.by_model.setdefault(model, {})
        by_class[error_class] = by_class.get(error_class, 0) + 1


@final
class EdgeMetrics:
    """The Edge's Prometheus metrics: scrape-time gauges, event counters and hook counters.

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
        self._gauges = SnapshotCollector(admission, level)
        self._front_door: Callable[[], OverloadStatus] | None = None
        self.registry.register(self._gauges)
        self._failures = _Failures(self.registry)
        self._declare_request_metrics(self.registry)
        self._declare_node_metrics(self.registry)
        self._tenant_rejected = Counter(
            "iop_tenant_rejected",
            "Requests refused by their tenant's quota or band (tenant_max_queue, tenant_shed) or a full queue.",
            ("tenant", "code"),
            registry=self.registry,
        )
        # Closed label sets start at 0, so rate() and absence alerts work from the first scrape.
        for outcome in LEASE_OUTCOMES:
            self._lease_endings.labels(outcome)
        for result in REFRESH_RESULTS:
            self._refreshes.labels(result)
        for reason in PENDING_CLOSE_REASONS:
            self._node_pending_closed.labels(reason)

    def _declare_request_metrics(self, registry: CollectorRegistry) -> None:
        self._admitted = Counter(
            "iop_admitted",
            "Leases granted (from admission events).",
            ("model", "node", "provider"),
            registry=registry,
        )
        self._rejected = Counter(
            "iop_rejected",
            "Requests refused: admission errors (from events) and provider_busy (from the Edge).",
            ("model", "reason"),
            registry=registry,
        )
        self._lease_endings = Counter(
            "iop_lease_endings",
            "Admitted requests that ended, by outcome.",
            ("outcome",),
            registry=registry,
        )
        self._retries = Counter(
            "iop_retries",
            "Attempts retried on another candidate before the first byte, by the failure that caused it.",
            ("model", "reason"),
            registry=registry,
        )
        self._refreshes = Counter(
            "iop_config_refreshes",
            "Live config refreshes, by result.",
            ("result",),
            registry=registry,
        )
        self._queue_wait = Histogram(
            "iop_queue_wait_seconds",
            "Time granted requests spent queued (0 when admitted at once).",
            ("model",),
            buckets=_QUEUE_WAIT_BUCKETS,
            registry=registry,
        )
        self._request_duration = Histogram(
            "iop_request_duration_seconds",
            "Duration of admitted requests, lease grant to lease end.",
            ("model",),
            buckets=_REQUEST_DURATION_BUCKETS,
            registry=registry,
        )
        # The series every admitted request touches.
        self._admitted_by = _Series(self._admitted)
        self._queue_wait_by = _Series(self._queue_wait)
        self._lease_endings_by = _Series(self._lease_endings)
        self._request_duration_by = _Series(self._request_duration)

    def _declare_node_metrics(self, registry: CollectorRegistry) -> None:
        self._node_connects = Counter(
            "iop_node_connects",
            "Accepted node registrations.",
            ("node",),
            registry=registry,
        )
        self._node_disconnects = Counter(
            "iop_node_disconnects",
            "Authoritative node disconnects, by cause.",
            ("node", "cause"),
            registry=registry,
        )
        self._node_pending = Gauge(
            "iop_node_pending_connections",
            "Connections to the node socket between accept and registration.",
            registry=registry,
        )
        self._answer_bytes_held = Gauge(
            "iop_answer_bytes_held",
            "Bytes of non-stream answers the Edge holds until they are written to their clients (bounded by answer_budget_bytes).",
            registry=registry,
        )
        self._node_pending_closed = Counter(
            "iop_node_pending_closed",
            "Unregistered node-socket connections the Edge closed, by reason "
            "(a pending cap was reached at accept, or the handshake deadline passed).",
            ("reason",),
            registry=registry,
        )
        self._node_registration_failures = Counter(
            "iop_node_registration_failures",
            "Rejected node registrations, by reject code and class of source address.",
            ("reason", "address_class"),
            registry=registry,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Follow admission events and count them, until cancelled.

        Subscribes with a 4096-event buffer, calls ``task_status.started()``
        once subscribed (use ``await nursery.start(metrics.run)``), then
        consumes events: every event waiting at each wake-up (a grant per
        admitted request: one scheduling round of this task each was about a
        thirtieth of the Edge's CPU per request at concurrency 64). Checkpoints
        while waiting for events; cancellation ends it and closes the
        subscription, losing nothing but future events.
        """
        async with self._admission.subscribe(buffer=4096) as events:
            task_status.started()
            async for event in events:
                self._observe(event)
                while True:
                    try:
                        event = events.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                    self._observe(event)

    def _observe(self, event: AdmissionEvent) -> None:
        kind = event.kind
        if kind == "granted":
            assert event.model is not None and event.provider is not None
            node, provider = self._node_label(event.provider.node_id), event.provider.provider_id
            self._admitted_by(event.model, node, provider if self._gauges.level == "provider" else "").inc()
            self._queue_wait_by(event.model).observe(event.waited or 0.0)
        elif kind == "rejected":
            reason = event.reason or "unknown"
            self._rejected.labels(self._model_label(event.model), REASON_CODES.get(reason, reason)).inc()
        elif kind == "timed_out":
            self._rejected.labels(self._model_label(event.model), "queue_timeout").inc()

    def _model_label(self, model: str | None) -> str:
        """A configured model key as itself; any other name a client sent as ``unknown_model``, so
        the series stay as many as the config's keys whatever clients invent [metrics]."""
        if not model:
            return ""
        return model if model in self._admission.config.models else UNKNOWN_MODEL

    def _node_label(self, node_id: str) -> str:
        """``node_id``, or ``""`` where series are Edge-wide (``per_node`` False)."""
        return "" if self._gauges.level == "edge" else node_id

    # ------------------------------------------------------------------ hooks

    def request_rejected(self, model: str, reason: str) -> None:
        """Count a refusal that admission events do not show, e.g. ``provider_busy``.

        Raises:
            ValueError: ``reason`` is not one of :data:`REJECTION_REASONS`.
        """
        check_label(reason, REJECTION_REASONS, "rejection reason")
        self._rejected.labels(model, reason).inc()

    def rejection_counter(self, model: str, reason: str) -> Callable[[], None]:
        """What :meth:`request_rejected` does for ``model`` and ``reason``, looked up once (a hot path's).

        Raises:
            ValueError: ``reason`` is not one of :data:`REJECTION_REASONS`.
        """
        check_label(reason, REJECTION_REASONS, "rejection reason")
        return self._rejected.labels(model, reason).inc

    def tenant_rejected(self, tenant: str, code: str) -> None:
        """Count a tenant's refusal ([tenant-edge]); ``tenant`` is one admission resolved (configured or
        ``default``), so the label set is bounded by the config."""
        self._tenant_rejected.labels(tenant, code).inc()

    def lease_ended(self, model: str, outcome: str, duration: float) -> None:
        """Count an admitted request that ended, and observe its duration in seconds.

        Raises:
            ValueError: ``outcome`` is not one of :data:`LEASE_OUTCOMES`.
        """
        check_label(outcome, LEASE_OUTCOMES, "lease outcome")
        self._lease_endings_by(outcome).inc()
        self._request_duration_by(model).observe(duration)

    def request_failed(self, model: str, error_class: str) -> None:
        """Count a request that failed with ``error_class`` ([error-classes]); also in :attr:`failures`.

        Raises:
            ValueError: ``error_class`` is not one of :data:`ERROR_CLASSES`.
        """
        self._failures.count(self._model_label(model), error_class)

    @property
    def failures(self) -> dict[str, dict[str, int]]:
        """Failed requests by model and error class since start (``/status``'s ``failures``)."""
        return self._failures.by_model

    def retried(self, model: str, reason: str) -> None:
        """Count an attempt retried on another candidate ([failover-before-first-byte]).

        Raises:
            ValueError: ``reason`` is not one of :data:`RETRY_REASONS`.
        """
        check_label(reason, RETRY_REASONS, "retry reason")
        self._retries.labels(model, reason).inc()

    def node_connected(self, node_id: str) -> None:
        """Count an accepted registration of ``node_id``."""
        self._node_connects.labels(self._node_label(node_id)).inc()

    def node_disconnected(self, node_id: str, cause: DisconnectCause) -> None:
        """Count an authoritative disconnect of ``node_id`` (not a stale or rejected one).

        Raises:
            ValueError: ``cause`` is not one of :data:`DISCONNECT_CAUSES`.
        """
        check_label(cause, DISCONNECT_CAUSES, "disconnect cause")
        self._node_disconnects.labels(self._node_label(node_id), cause).inc()

    def follow_front_door(self, read: Callable[[], OverloadStatus]) -> None:
        """Read the overload gauges from ``read()`` (``FrontDoor.status``) at every scrape."""
        self._front_door = read
        self.registry.register(FrontDoorCollector(read))

    def follow_node_socket(self, pending: Callable[[], int]) -> None:
        """Read ``iop_node_pending_connections`` from ``pending()`` at every scrape."""
        self._node_pending.set_function(pending)

    def follow_answers(self, held: Callable[[], int]) -> None:
        """Read ``iop_answer_bytes_held`` from ``held()`` at every scrape."""
        self._answer_bytes_held.set_function(held)

    def node_pending_closed(self, reason: str) -> None:
        """Count an unregistered node-socket connection the Edge closed.

        Raises:
            ValueError: ``reason`` is not one of :data:`PENDING_CLOSE_REASONS`.
        """
        check_label(reason, PENDING_CLOSE_REASONS, "pending close reason")
        self._node_pending_closed.labels(reason).inc()

    def node_registration_rejected(self, code: str, address_class: str) -> None:
        """Count a rejected registration (``bad_token``, ``unknown_node``, ...) from a class of address.

        Raises:
            ValueError: ``address_class`` is not one of :data:`ADDRESS_CLASSES`.
        """
        check_label(address_class, ADDRESS_CLASSES, "address class")
        self._node_registration_failures.labels(code, address_class).inc()

    def refresh_result(self, result: str) -> None:
        """Count a config refresh: ``ok`` (applied) or ``rejected`` (old config kept).

        Raises:
            ValueError: ``result`` is not one of :data:`REFRESH_RESULTS`.
        """
        check_label(result, REFRESH_RESULTS, "refresh result")
        self._refreshes.labels(result).inc()

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

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
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable, Iterator
from typing import Final, Generic, Literal, NamedTuple, TypeVar, final, get_args

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from iop_admission import Admission, AdmissionEvent, ProviderSnapshot, Snapshot, TenantSnapshot
from iop_edge._off_loop import run_off_loop, snapshot_in_slices
from iop_edge.api.failover import RETRY_REASONS
from iop_edge.status import OverloadStatus

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
]

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
_REASON_CODES: Final = {
    "QueueFull": "queue_full",
    "QueueTimeout": "queue_timeout",
    "Unavailable": "unavailable",
    "ModelNotFound": "model_not_found",
    "TenantLimitExceeded": "tenant_limit",
}

#: The queue timeout defaults to 30 s; waits beyond a minute are off the scale anyway.
_QUEUE_WAIT_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: LLM requests run from well under a second to many minutes (long streamed generations).
_REQUEST_DURATION_BUCKETS: Final = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

#: Per-provider gauges: metric name suffix, help text, and how to read it from a ProviderSnapshot.
_PROVIDER_GAUGES: Final = (
    ("capacity", "Configured capacity of the provider (all model groups together).", lambda p: p.capacity),
    (
        "effective_capacity",
        "Capacity admission may use now: 0 while offline or disabled.",
        lambda p: p.effective_capacity,
    ),
    ("long_context_capacity", "Configured long-context slots of the provider.", lambda p: p.long_context_capacity),
    (
        "effective_long_context_capacity",
        "Long-context slots admission may use now: 0 while offline or disabled.",
        lambda p: p.effective_long_capacity,
    ),
    ("in_flight", "Live leases on the provider.", lambda p: p.in_flight),
    ("long_in_flight", "Live long-context leases on the provider.", lambda p: p.long_in_flight),
    (
        "queued",
        "Candidate pressure: waiters for which this provider is an eligible candidate "
        "(a waiter counts at each of its candidates; see iop_queue_depth for the true queue length).",
        lambda p: p.queued,
    ),
    ("long_queued", "Candidate pressure of long-context waiters.", lambda p: p.long_queued),
    (
        "connected",
        "1 if the provider's node is connected in its current generation, else 0.",
        lambda p: int(p.connected),
    ),
    (
        "generation",
        "Current connection generation of the provider's node (0: never connected).",
        lambda p: p.generation,
    ),
    (
        "ejected",
        "1 while the provider is ejected for consecutive failures (until its probe restores it), else 0.",
        lambda p: int(p.health == "ejected"),
    ),
    ("consecutive_failures", "Consecutive provider failures counted against the provider.", lambda p: p.failures),
    (
        "ejection_remaining_seconds",
        "Seconds until the provider's ejection time ends (0: not ejected, or its probe is due).",
        lambda p: p.ejection_left,
    ),
)

#: Per-provider counters read from the snapshot: name, help text, how to read it.
_PROVIDER_COUNTERS: Final[tuple[tuple[str, str, Callable[[ProviderSnapshot], int]], ...]] = (
    ("iop_ejections", "Ejections of the provider for consecutive failures.", lambda p: p.ejections),
    ("iop_probes", "Probe requests granted to the provider after an ejection.", lambda p: p.probes),
)


def _check(value: str, allowed: Iterable[str], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(sorted(allowed))}")


# Per-node aggregation (metrics_per_provider: false): these two are the node's own
# state, the same on each of its providers; every other gauge is summed. Edge-wide
# (metrics_per_node: false) ``connected`` is summed too and ``generation`` left out.
_NODE_LEVEL: Final = frozenset(("connected", "generation"))

Level = Literal["provider", "node", "edge"]
"""How finely the per-provider series are labelled: ``node`` and ``provider``, ``node`` only, none."""
_LABELS: Final[dict[str, tuple[str, ...]]] = {"provider": ("node", "provider"), "node": ("node",), "edge": ()}


def _where(level: Level, p: ProviderSnapshot) -> tuple[str, ...]:
    """The label values of provider ``p``'s series at ``level``."""
    if level == "provider":
        return (p.node_id, p.provider_id)
    return (p.node_id,) if level == "node" else ()


_Metric = TypeVar("_Metric", Counter, Histogram)


@final
class _Series(Generic[_Metric]):
    """The children of one labelled metric, each looked up through ``labels()`` once.

    ``labels()`` converts and checks the label values and takes the metric's
    lock on every call: a few microseconds, several times on every admitted
    request's path. A child never changes once made (nothing here removes
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


class _Reading(NamedTuple):
    """What the scrape-time collectors read, taken on the event loop (see :meth:`EdgeMetrics.render_off_loop`)."""

    snapshot: Snapshot
    models: tuple[str, ...]
    front_door: OverloadStatus | None


#: Set around a render in a worker thread: the collectors read it instead of live state.
_READING: contextvars.ContextVar[_Reading | None] = contextvars.ContextVar("iop_metrics_reading", default=None)


@final
class _SnapshotCollector(Collector):
    """Gauges read from ``admission.snapshot()`` at every scrape.

    ``level`` ``node`` labels them by node only: one series per node and gauge
    (sums over its providers) instead of one per provider; ``edge``: one series
    per gauge, the sum over every provider.
    """

    def __init__(self, admission: Admission, level: Level) -> None:
        self._admission = admission
        self.level = level

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        reading = _READING.get()
        if reading is None:
            reading = _Reading(self._admission.snapshot(), tuple(self._admission.config.models), None)
        return self._families(reading)

    def _families(self, reading: _Reading | None) -> Iterator[Metric]:
        """The gauge families, with samples from ``reading`` (none for ``describe``)."""
        snap = reading.snapshot if reading is not None else None
        providers: tuple[ProviderSnapshot, ...] = snap.providers if snap is not None else ()
        level = self.level
        for suffix, documentation, read in _PROVIDER_GAUGES:
            if level == "edge" and suffix == "generation":
                continue  # a sum of generations means nothing
            family = GaugeMetricFamily(f"iop_{suffix}", documentation, labels=_LABELS[level])
            summed = level == "edge" or suffix not in _NODE_LEVEL
            totals: dict[tuple[str, ...], float] = {}
            for p in providers:
                where = _where(level, p)
                seen = totals.get(where)
                totals[where] = read(p) if seen is None else seen + read(p) if summed else seen
            for where, total in totals.items():
                family.add_metric(where, total)
            yield family
        yield from _health_families(snap, reading.models if reading else (), level)
        yield from _tenant_families(snap.tenants if snap is not None else ())
        edge_wide = (
            (
                "iop_queue_depth",
                "Waiters in the Edge-wide queue (the true queue length).",
                snap.queue_depth if snap else None,
            ),
            (
                "iop_max_queue",
                "Edge-wide bound on waiters (provider_pool.max_queue).",
                snap.max_queue if snap else None,
            ),
            (
                "iop_queue_timeout_seconds",
                "Edge-wide queue timeout (provider_pool.queue_timeout_ms / 1000).",
                snap.queue_timeout if snap else None,
            ),
        )
        for name, documentation, value in edge_wide:
            yield GaugeMetricFamily(name, documentation, value=value)
        yield CounterMetricFamily(
            "iop_events_dropped",
            "Admission events dropped because a subscriber's buffer was full (all subscribers). "
            "While it grows, event-fed counters undercount.",
            value=snap.events_dropped if snap else None,
        )


#: Per-tenant gauges ([tenant-edge]): name suffix, help, reading. Labelled ``tenant`` with the
#: snapshot's tenants only -- the configured ones, ``default``, and a dropped one until it drains.
_TENANT_GAUGES: Final[tuple[tuple[str, str, Callable[[TenantSnapshot], float]], ...]] = (
    ("weight", "The tenant's weight in its band (tenants[].weight).", lambda t: t.weight),
    ("priority", "The tenant's band (tenants[].priority).", lambda t: t.priority),
    ("waiting", "The tenant's waiters now.", lambda t: t.waiting),
    ("in_flight", "The tenant's leases now, over every provider.", lambda t: t.in_flight),
    ("share", "The tenant's part of the latest 1,000 grants (0 to 1).", lambda t: t.share),
    (
        "cost_charged",
        "Cost charged to the tenant so far: requests, or tokens after settlement.",
        lambda t: t.cost_charged,
    ),
)


def _tenant_families(tenants: tuple[TenantSnapshot, ...]) -> Iterator[Metric]:
    """``iop_tenant_*`` from the snapshot's tenant rows (none without tenants)."""
    for suffix, documentation, read in _TENANT_GAUGES:
        family = GaugeMetricFamily(f"iop_tenant_{suffix}", documentation, labels=("tenant",))
        for t in tenants:
            family.add_metric((t.name,), read(t))
        yield family
    grants = CounterMetricFamily("iop_tenant_grants", "Leases granted to the tenant.", labels=("tenant",))
    for t in tenants:
        grants.add_metric((t.name,), t.grants)
    yield grants


def _health_families(snap: Snapshot | None, models: Iterable[str], level: Level) -> Iterator[Metric]:
    """[outlier-ejection] ejection and probe counters (per provider, or summed per node or Edge-wide) and panic mode."""
    providers = snap.providers if snap is not None else ()
    for name, documentation, read in _PROVIDER_COUNTERS:
        counter = CounterMetricFamily(name, documentation, labels=_LABELS[level])
        totals: dict[tuple[str, ...], int] = {}
        for p in providers:
            where = _where(level, p)
            totals[where] = totals.get(where, 0) + read(p)
        for where, value in totals.items():
            counter.add_metric(where, value)
        yield counter
    panic = GaugeMetricFamily(
        "iop_panic_mode",
        "1 while every eligible candidate of the model is ejected and requests go to them anyway, else 0.",
        labels=("model",),
    )
    if snap is not None:
        for model in models:
            panic.add_metric((model,), int(model in snap.panic))
    yield panic


@final
class _FrontDoorCollector(Collector):
    """The front door's figures (``FrontDoor.status()``), read at every scrape."""

    def __init__(self, read: Callable[[], OverloadStatus]) -> None:
        self._read = read

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        reading = _READING.get()
        return self._families(reading.front_door if reading is not None and reading.front_door else self._read())

    @staticmethod
    def _families(status: OverloadStatus | None) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "iop_loop_lag_seconds",
            "How late the Edge's event loop ran a 50 ms timer, last sample.",
            value=status.loop_lag_ms / 1000 if status else None,
        )
        yield GaugeMetricFamily(
            "iop_http_connections_open",
            "Open connections on the HTTP listener.",
            value=status.open_connections if status else None,
        )
        yield GaugeMetricFamily(
            "iop_http_connections_paused",
            "HTTP connections left unread after a refusal until the client's return time (pacing).",
            value=status.paused_connections if status else None,
        )
        yield GaugeMetricFamily(
            "iop_shedding",
            "1 while new requests are shed (503 overloaded), else 0.",
            value=int(status.shedding) if status else None,
        )
        yield CounterMetricFamily(
            "iop_http_connections_refused",
            "Connections closed at accept because overload.max_connections were open.",
            value=status.refused_connections if status else None,
        )


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
        self._gauges = _SnapshotCollector(admission, level)
        self._front_door: Callable[[], OverloadStatus] | None = None
        self.registry.register(self._gauges)
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
            self._rejected.labels(event.model or "", _REASON_CODES.get(reason, reason)).inc()
        elif kind == "timed_out":
            self._rejected.labels(event.model or "", "queue_timeout").inc()

    def _node_label(self, node_id: str) -> str:
        """``node_id``, or ``""`` where series are Edge-wide (``per_node`` False)."""
        return "" if self._gauges.level == "edge" else node_id

    # ------------------------------------------------------------------ hooks

    def request_rejected(self, model: str, reason: str) -> None:
        """Count a refusal that admission events do not show, e.g. ``provider_busy``.

        Raises:
            ValueError: ``reason`` is not one of :data:`REJECTION_REASONS`.
        """
        _check(reason, REJECTION_REASONS, "rejection reason")
        self._rejected.labels(model, reason).inc()

    def rejection_counter(self, model: str, reason: str) -> Callable[[], None]:
        """What :meth:`request_rejected` does for ``model`` and ``reason``, looked up once (a hot path's).

        Raises:
            ValueError: ``reason`` is not one of :data:`REJECTION_REASONS`.
        """
        _check(reason, REJECTION_REASONS, "rejection reason")
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
        _check(outcome, LEASE_OUTCOMES, "lease outcome")
        self._lease_endings_by(outcome).inc()
        self._request_duration_by(model).observe(duration)

    def retried(self, model: str, reason: str) -> None:
        """Count an attempt retried on another candidate ([failover-before-first-byte]).

        Raises:
            ValueError: ``reason`` is not one of :data:`RETRY_REASONS`.
        """
        _check(reason, RETRY_REASONS, "retry reason")
        self._retries.labels(model, reason).inc()

    def node_connected(self, node_id: str) -> None:
        """Count an accepted registration of ``node_id``."""
        self._node_connects.labels(self._node_label(node_id)).inc()

    def node_disconnected(self, node_id: str, cause: DisconnectCause) -> None:
        """Count an authoritative disconnect of ``node_id`` (not a stale or rejected one).

        Raises:
            ValueError: ``cause`` is not one of :data:`DISCONNECT_CAUSES`.
        """
        _check(cause, DISCONNECT_CAUSES, "disconnect cause")
        self._node_disconnects.labels(self._node_label(node_id), cause).inc()

    def follow_front_door(self, read: Callable[[], OverloadStatus]) -> None:
        """Read the overload gauges from ``read()`` (``FrontDoor.status``) at every scrape."""
        self._front_door = read
        self.registry.register(_FrontDoorCollector(read))

    def follow_node_socket(self, pending: Callable[[], int]) -> None:
        """Read ``iop_node_pending_connections`` from ``pending()`` at every scrape."""
        self._node_pending.set_function(pending)

    def node_pending_closed(self, reason: str) -> None:
        """Count an unregistered node-socket connection the Edge closed.

        Raises:
            ValueError: ``reason`` is not one of :data:`PENDING_CLOSE_REASONS`.
        """
        _check(reason, PENDING_CLOSE_REASONS, "pending close reason")
        self._node_pending_closed.labels(reason).inc()

    def node_registration_rejected(self, code: str, address_class: str) -> None:
        """Count a rejected registration (``bad_token``, ``unknown_node``, ...) from a class of address.

        Raises:
            ValueError: ``address_class`` is not one of :data:`ADDRESS_CLASSES`.
        """
        _check(address_class, ADDRESS_CLASSES, "address class")
        self._node_registration_failures.labels(code, address_class).inc()

    def refresh_result(self, result: str) -> None:
        """Count a config refresh: ``ok`` (applied) or ``rejected`` (old config kept).

        Raises:
            ValueError: ``result`` is not one of :data:`REFRESH_RESULTS`.
        """
        _check(result, REFRESH_RESULTS, "refresh result")
        self._refreshes.labels(result).inc()

    # ---------------------------------------------------------------- scrape

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every metric, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def render_off_loop(self) -> tuple[bytes, str]:
        """:meth:`render`, with the text written in a worker thread ([status-at-size]).

        The admission snapshot is read on the loop a slice at a time
        (:func:`snapshot_in_slices`), the front door's figures at once; turning
        them and the counters into text (about 8 µs per series: over a second
        at 10,000 providers) runs off the loop, so streams keep flowing
        meanwhile. Checkpoints.
        """
        snapshot = await snapshot_in_slices(self._admission)
        front_door = self._front_door() if self._front_door is not None else None
        reading = _Reading(snapshot, tuple(self._admission.config.models), front_door)
        token = _READING.set(reading)  # the worker thread runs in a copy of this context
        try:
            return await run_off_loop(self.render)
        finally:
            _READING.reset(token)

    def __repr__(self) -> str:
        return f"<EdgeMetrics of {self._admission!r}>"

"""The requests' family of the Edge's metrics: :class:`RequestMetrics`, fed by admission events and the API's hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Generic, TypeVar, final

import trio
from prometheus_client import CollectorRegistry, Counter, Histogram

from iop_admission import Admission, AdmissionEvent
from iop_edge.admission_feed import feed
from iop_edge.api.failover import RETRY_REASONS
from iop_edge.api.rejections import ERROR_CLASSES
from iop_edge.metrics.collectors import Level
from iop_edge.metrics.labels import LEASE_OUTCOMES, REASON_CODES, REJECTION_REASONS, ClosedCounter, check_label

#: The queue timeout defaults to 30 s; waits beyond a minute are off the scale anyway.
_QUEUE_WAIT_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: LLM requests run from well under a second to many minutes (long streamed generations).
_REQUEST_DURATION_BUCKETS: Final = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


_Metric = TypeVar("_Metric", Counter, Histogram)


UNKNOWN_MODEL = "unknown_model"
"""The ``model`` label of a refusal for a name that is no configured model key."""


@final
class _Series(Generic[_Metric]):
    """The children of one labelled metric every admitted request touches, each looked up through ``labels()`` once.

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


def _by_model(
    registry: CollectorRegistry, name: str, documentation: str, buckets: tuple[float, ...]
) -> _Series[Histogram]:
    """The children of a histogram of seconds labelled by ``model``."""
    return _Series(Histogram(name, documentation, ("model",), buckets=buckets, registry=registry))


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
class RequestMetrics:
    """What became of the requests: admissions, refusals, waits, endings, retries and failures.

    Admission events feed ``iop_admitted_total``, ``iop_queue_wait_seconds`` and
    most of ``iop_rejected_total`` (best effort, see :meth:`run`); the API's
    hooks count the rest exactly.

    Args:
        admission: followed by :meth:`run`; its config's model keys bound the ``model`` label.
        registry: the Edge's registry the metrics are registered in.
        level: ``provider`` labels admissions by node and provider, ``node`` by
            node only (``provider=""``), ``edge`` by neither (both ``""``).
    """

    def __init__(self, admission: Admission, registry: CollectorRegistry, level: Level) -> None:
        self._admission = admission
        self._level = level
        self._failures = _Failures(registry)
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
        self._lease_endings = ClosedCounter(
            registry,
            "iop_lease_endings",
            "Admitted requests that ended, by outcome.",
            ("outcome", LEASE_OUTCOMES),
            "lease outcome",
        )
        self._retries = Counter(
            "iop_retries",
            "Attempts retried on another candidate before the first byte, by the failure that caused it.",
            ("model", "reason"),
            registry=registry,
        )
        self._tenant_rejected = Counter(
            "iop_tenant_rejected",
            "Requests refused by their tenant's quota or band (tenant_max_queue, tenant_shed) or a full queue.",
            ("tenant", "code"),
            registry=registry,
        )
        self._admitted_by = _Series(self._admitted)
        self._queue_wait_by = _by_model(
            registry,
            "iop_queue_wait_seconds",
            "Time granted requests spent queued (0 when admitted at once).",
            _QUEUE_WAIT_BUCKETS,
        )
        self._request_duration_by = _by_model(
            registry,
            "iop_request_duration_seconds",
            "Duration of admitted requests, lease grant to lease end.",
            _REQUEST_DURATION_BUCKETS,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Follow admission events and count them, until cancelled: :func:`iop_edge.admission_feed.feed`
        with :meth:`observe` alone (the Edge feeds :meth:`observe` beside its other observers)."""
        await feed(self._admission, (self.observe,), task_status=task_status)

    def observe(self, event: AdmissionEvent) -> None:
        """Count one admission event."""
        kind = event.kind
        if kind == "granted":
            assert event.model is not None and event.provider is not None
            node = "" if self._level == "edge" else event.provider.node_id
            provider = event.provider.provider_id if self._level == "provider" else ""
            self._admitted_by(event.model, node, provider).inc()
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

    def request_rejected(self, model: str, reason: str) -> None:
        """Count a refusal that admission events do not show, e.g. ``provider_busy``.

        Raises:
            ValueError: ``reason`` is not one of :data:`REJECTION_REASONS`.
        """
        self.rejection_counter(model, reason)()

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
        self._lease_endings.count(outcome)
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

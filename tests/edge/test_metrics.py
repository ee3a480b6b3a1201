"""EdgeMetrics: scrape-time gauges, event-fed counters, explicit hooks ([snapshot-source], [cross-model-tests]).

Everything runs on ``MockClock(autojump_threshold=0)``; event consumption is
awaited with ``trio.testing.wait_all_tasks_blocked()``. Scrapes are parsed with
``prometheus_client.parser`` and compared exactly.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from iop_admission import (
    Admission,
    AdmissionError,
    ModelGroup,
    ModelNotFound,
    PoolConfig,
    ProviderKey,
    ProviderReport,
    ProviderSpec,
    QueueFull,
    QueuePolicy,
    QueueTimeout,
    Snapshot,
    Unavailable,
)
from iop_edge.metrics import EdgeMetrics

GPU0 = ProviderKey("node-a", "gpu0")
BIG = "ornith:35b"
FAST = "ornith-fast"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def shared_pool(*, max_queue: int = 1, queue_timeout: float = 5.0) -> PoolConfig:
    """ornith:35b and ornith-fast on the one capacity-1 provider node-a/gpu0."""
    return PoolConfig(
        policy=QueuePolicy(max_queue=max_queue, queue_timeout=queue_timeout),
        providers={
            GPU0: ProviderSpec(
                capacity=1,
                long_context_capacity=1,
                context_window_tokens=32768,
                total_context_tokens=32768,
                priority=3,
            )
        },
        models={BIG: ModelGroup(candidates=(GPU0,)), FAST: ModelGroup(candidates=(GPU0,))},
    )


def scrape(metrics: EdgeMetrics) -> Samples:
    """Every sample of one scrape, keyed by (sample name, labels); ``_created`` left out."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=")
    samples: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if not s.name.endswith("_created"):
                samples[s.name, frozenset(s.labels.items())] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[name, frozenset(labels.items())]


def series(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def assert_gauges_match(samples: Samples, snap: Snapshot) -> None:
    """[snapshot-source] every gauge equals the snapshot admission reads."""
    fields = {
        "iop_capacity": "capacity",
        "iop_effective_capacity": "effective_capacity",
        "iop_long_context_capacity": "long_context_capacity",
        "iop_effective_long_context_capacity": "effective_long_capacity",
        "iop_in_flight": "in_flight",
        "iop_long_in_flight": "long_in_flight",
        "iop_revoked_in_flight": "revoked_in_flight",
        "iop_revoked_long_in_flight": "revoked_long_in_flight",
        "iop_reserved_tokens": "reserved_tokens",
        "iop_token_headroom": "token_headroom",
        "iop_queued": "queued",
        "iop_long_queued": "long_queued",
        "iop_connected": "connected",
        "iop_generation": "generation",
    }
    for name, field in fields.items():
        expected = {
            frozenset({("node", p.node_id), ("provider", p.provider_id)}): float(getattr(p, field))
            for p in snap.providers
        }
        assert series(samples, name) == expected, name
    assert value(samples, "iop_queue_depth") == snap.queue_depth
    assert value(samples, "iop_max_queue") == snap.max_queue
    assert value(samples, "iop_queue_timeout_seconds") == snap.queue_timeout
    assert value(samples, "iop_events_dropped_total") == snap.events_dropped


async def hold(admission: Admission, model: str, release: trio.Event, errors: list[str]) -> None:
    """One request: hold a lease on ``model`` until ``release`` is set; record an admission error."""
    try:
        async with admission.lease(model):
            await release.wait()
    except AdmissionError as exc:
        errors.append(type(exc).__name__)


@pytest.mark.req("cross-model-tests", "snapshot-source")
async def test_counters_gauges_and_histograms_after_cross_model_traffic(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """[cross-model-tests] [snapshot-source] two model keys on one capacity-1 provider:
    grants, a QueueFull, a QueueTimeout, an Unavailable and a ModelNotFound, plus every hook."""
    admission = Admission(shared_pool())
    metrics = EdgeMetrics(admission)
    admission.connect("node-a")
    errors: list[str] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(metrics.run)

        # ornith:35b holds gpu0; ornith-fast queues behind it; a third request finds the queue full.
        big_done, fast_done = trio.Event(), trio.Event()
        nursery.start_soon(hold, admission, BIG, big_done, errors)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, admission, FAST, fast_done, errors)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(QueueFull):
            async with admission.lease(BIG):
                pass
        await trio.sleep(2.0)
        big_done.set()  # ornith-fast is granted after 2.0 s queued
        await trio.testing.wait_all_tasks_blocked()

        # ornith:35b queues behind ornith-fast and times out after 5 s.
        with pytest.raises(QueueTimeout):
            async with admission.lease(BIG):
                pass
        fast_done.set()
        await trio.testing.wait_all_tasks_blocked()

        with pytest.raises(ModelNotFound):
            async with admission.lease("ornith:nope"):
                pass
        admission.disconnect("node-a", admission.generation("node-a"))
        with pytest.raises(Unavailable):
            async with admission.lease(FAST):
                pass
        admission.connect("node-a")

        metrics.request_rejected(FAST, "provider_busy")
        metrics.lease_ended(BIG, "ok", 2.0)
        metrics.lease_ended(FAST, "ok", 5.0)
        metrics.lease_ended(FAST, "error", 0.2)
        metrics.lease_ended(BIG, "revoked", 40.0)
        metrics.node_connected("node-a")
        metrics.node_connected("node-a")
        metrics.node_disconnected("node-a", "graceful")
        metrics.refresh_result("ok")
        metrics.refresh_result("rejected")
        metrics.refresh_result("rejected")

        # Leave live state behind for the gauges: one lease held, one waiter queued.
        last_done = trio.Event()
        nursery.start_soon(hold, admission, BIG, last_done, errors)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, admission, FAST, last_done, errors)
        await trio.testing.wait_all_tasks_blocked()

        samples = scrape(metrics)
        snap = admission.snapshot()
        assert (snap.queue_depth, snap.provider("node-a", "gpu0").in_flight) == (1, 1)
        assert_gauges_match(samples, snap)
        assert value(samples, "iop_generation", node="node-a", provider="gpu0") == 2
        assert value(samples, "iop_queued", node="node-a", provider="gpu0") == 1

        assert series(samples, "iop_admitted_total") == {
            frozenset({("model", BIG), ("node", "node-a"), ("provider", "gpu0")}): 2.0,
            frozenset({("model", FAST), ("node", "node-a"), ("provider", "gpu0")}): 1.0,
        }
        assert series(samples, "iop_rejected_total") == {
            frozenset({("model", BIG), ("reason", "queue_full")}): 1.0,
            frozenset({("model", BIG), ("reason", "queue_timeout")}): 1.0,
            frozenset({("model", "unknown_model"), ("reason", "model_not_found")}): 1.0,
            frozenset({("model", FAST), ("reason", "unavailable")}): 1.0,
            frozenset({("model", FAST), ("reason", "provider_busy")}): 1.0,
        }
        assert series(samples, "iop_lease_endings_total") == {
            frozenset({("outcome", "ok")}): 2.0,
            frozenset({("outcome", "error")}): 1.0,
            frozenset({("outcome", "client_error")}): 0.0,
            frozenset({("outcome", "cancelled")}): 0.0,
            frozenset({("outcome", "revoked")}): 1.0,
        }
        assert series(samples, "iop_node_connects_total") == {frozenset({("node", "node-a")}): 2.0}
        assert series(samples, "iop_node_disconnects_total") == {
            frozenset({("node", "node-a"), ("cause", "graceful")}): 1.0
        }
        assert series(samples, "iop_config_refreshes_total") == {
            frozenset({("result", "ok")}): 1.0,
            frozenset({("result", "rejected")}): 2.0,
        }

        # Queue waits: ornith:35b granted twice at once; ornith-fast after exactly 2.0 virtual seconds.
        assert value(samples, "iop_queue_wait_seconds_count", model=BIG) == 2
        assert value(samples, "iop_queue_wait_seconds_sum", model=BIG) == 0.0
        assert value(samples, "iop_queue_wait_seconds_count", model=FAST) == 1
        assert value(samples, "iop_queue_wait_seconds_sum", model=FAST) == 2.0
        assert value(samples, "iop_queue_wait_seconds_bucket", model=FAST, le="1.0") == 0
        assert value(samples, "iop_queue_wait_seconds_bucket", model=FAST, le="2.5") == 1
        assert value(samples, "iop_request_duration_seconds_count", model=BIG) == 2
        assert value(samples, "iop_request_duration_seconds_sum", model=BIG) == 42.0
        assert value(samples, "iop_request_duration_seconds_bucket", model=BIG, le="30.0") == 1
        assert value(samples, "iop_request_duration_seconds_bucket", model=BIG, le="+Inf") == 2
        assert value(samples, "iop_request_duration_seconds_sum", model=FAST) == 5.2

        last_done.set()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()

    assert errors == []
    final = scrape(metrics)
    assert_gauges_match(final, admission.snapshot())
    assert value(final, "iop_in_flight", node="node-a", provider="gpu0") == 0
    assert value(final, "iop_queue_depth") == 0
    assert value(final, "iop_admitted_total", model=FAST, node="node-a", provider="gpu0") == 2
    assert admission._events.subscribers == []  # run() unsubscribed when cancelled


@pytest.mark.req("offline-snapshot")
async def test_offline_provider_gauges_and_dropped_events(autojump_clock: trio.testing.MockClock) -> None:
    """[offline-snapshot] a never-connected node reads connected 0, effective capacity 0;
    a saturated subscriber shows in iop_events_dropped_total while run() keeps counting."""
    admission = Admission(shared_pool())
    metrics = EdgeMetrics(admission)
    samples = scrape(metrics)
    assert_gauges_match(samples, admission.snapshot())
    assert value(samples, "iop_connected", node="node-a", provider="gpu0") == 0
    assert value(samples, "iop_effective_capacity", node="node-a", provider="gpu0") == 0
    assert value(samples, "iop_capacity", node="node-a", provider="gpu0") == 1
    assert value(samples, "iop_generation", node="node-a", provider="gpu0") == 0

    async with trio.open_nursery() as nursery:
        await nursery.start(metrics.run)
        async with admission.subscribe(buffer=0):  # never read: every event to it is dropped
            admission.connect("node-a")
            for _ in range(3):
                async with admission.lease(BIG):
                    pass
            await trio.testing.wait_all_tasks_blocked()
            samples = scrape(metrics)
        nursery.cancel_scope.cancel()

    # connected + 3 x (granted, released) reached the full subscriber and were dropped.
    assert admission.snapshot().events_dropped == 7
    assert value(samples, "iop_events_dropped_total") == 7
    assert value(samples, "iop_admitted_total", model=BIG, node="node-a", provider="gpu0") == 3
    assert value(samples, "iop_connected", node="node-a", provider="gpu0") == 1


@pytest.mark.req("health-probe")
async def test_reported_health_is_one_state_per_provider_and_counted_per_node_and_edge() -> None:
    """[health-probe] ``iop_health_reported``: 1 at the state the node last reported (``none`` before
    any), 0 at the others; aggregated, how many providers are in each state."""
    gpu1 = ProviderKey("node-a", "gpu1")
    spec = ProviderSpec(capacity=2)
    config = PoolConfig(providers={GPU0: spec, gpu1: spec}, models={FAST: ModelGroup(candidates=(GPU0, gpu1))})
    admission = Admission(config)
    admission.connect("node-a")
    per = {
        level: EdgeMetrics(admission, per_provider=level == "provider", per_node=level != "edge")
        for level in ("provider", "node", "edge")
    }
    assert series(scrape(per["provider"]), "iop_health_reported") == {
        frozenset({("node", "node-a"), ("provider", p), ("state", s)}): float(s == "none")
        for p in ("gpu0", "gpu1")
        for s in ("ready", "not_ready", "stalled", "none")
    }
    admission.report_health(GPU0, ProviderReport("stalled", "no byte for 6.0 s", None, 1))
    admission.report_health(gpu1, ProviderReport("ready", "", 1, 1))
    samples = scrape(per["provider"])
    assert value(samples, "iop_health_reported", node="node-a", provider="gpu0", state="stalled") == 1
    assert value(samples, "iop_health_reported", node="node-a", provider="gpu0", state="none") == 0
    assert value(samples, "iop_health_reported", node="node-a", provider="gpu1", state="ready") == 1
    assert value(scrape(per["node"]), "iop_health_reported", node="node-a", state="stalled") == 1
    edge = scrape(per["edge"])
    assert {s: value(edge, "iop_health_reported", state=s) for s in ("ready", "not_ready", "stalled", "none")} == {
        "ready": 1,
        "not_ready": 0,
        "stalled": 1,
        "none": 0,
    }


def test_each_instance_has_its_own_registry() -> None:
    """Two Edges (or tests) in one process: no duplicate-timeseries error, nothing in the global registry."""
    admission = Admission(shared_pool())
    first, second = EdgeMetrics(admission), EdgeMetrics(admission)
    first.node_connected("node-a")
    assert value(scrape(first), "iop_node_connects_total", node="node-a") == 1
    assert series(scrape(second), "iop_node_connects_total") == {}
    assert REGISTRY.get_sample_value("iop_node_connects_total", {"node": "node-a"}) is None


@pytest.mark.parametrize(
    ("hook", "args", "message"),
    [
        ("request_rejected", (BIG, "busy"), "unknown rejection reason 'busy'"),
        ("lease_ended", (BIG, "done", 1.0), "unknown lease outcome 'done'"),
        ("node_disconnected", ("node-a", "bye"), "unknown disconnect cause 'bye'"),
        ("refresh_result", ("maybe",), "unknown refresh result 'maybe'"),
    ],
)
def test_hooks_refuse_label_values_outside_the_documented_sets(
    hook: str, args: tuple[object, ...], message: str
) -> None:
    """A typo in the Edge must not create a new time series silently."""
    metrics = EdgeMetrics(Admission(shared_pool()))
    with pytest.raises(ValueError, match=message):
        getattr(metrics, hook)(*args)


def test_hooks_on_every_request_count_into_the_same_series_each_time() -> None:
    """``lease_ended`` looks each child up once and keeps it: repeated calls add to one series per
    label set, and two instances still keep their own."""
    admission = Admission(shared_pool())
    metrics, other = EdgeMetrics(admission), EdgeMetrics(admission)
    for duration in (0.5, 1.5, 2.0):
        metrics.lease_ended(BIG, "ok", duration)
    metrics.lease_ended(FAST, "error", 0.25)
    other.lease_ended(BIG, "ok", 1.0)
    samples = scrape(metrics)
    assert value(samples, "iop_lease_endings_total", outcome="ok") == 3
    assert value(samples, "iop_lease_endings_total", outcome="error") == 1
    assert value(samples, "iop_request_duration_seconds_count", model=BIG) == 3
    assert value(samples, "iop_request_duration_seconds_sum", model=BIG) == 4.0
    assert value(samples, "iop_request_duration_seconds_count", model=FAST) == 1
    assert value(scrape(other), "iop_lease_endings_total", outcome="ok") == 1


async def test_model_names_clients_invent_share_one_series(autojump_clock: trio.testing.MockClock) -> None:
    """500 requests for made-up model names count as refusals of ``unknown_model``:
    the series of ``/metrics`` stay as many as the config's model keys (issue 37: what clients send
    never grows what the operators read)."""
    admission = Admission(shared_pool())
    metrics = EdgeMetrics(admission)
    admission.connect("node-a")
    async with trio.open_nursery() as nursery:
        await nursery.start(metrics.run)
        for i in range(500):
            with pytest.raises(ModelNotFound):
                async with admission.lease(f"made-up-{i}\n<b>"):
                    pass
        await trio.testing.wait_all_tasks_blocked()
        rejected = series(scrape(metrics), "iop_rejected_total")
        assert rejected == {frozenset({("model", "unknown_model"), ("reason", "model_not_found")}): 500.0}
        nursery.cancel_scope.cancel()

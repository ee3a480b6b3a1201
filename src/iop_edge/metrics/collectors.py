"""Scrape-time collectors: gauges and counters read from the admission snapshot and the front door.

**Gauges are read, never kept**: computed at scrape time from :meth:`Admission.snapshot`, so they
are the numbers admission itself uses and cannot drift.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable, Iterator
from typing import Final, Literal, NamedTuple, final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from iop_admission import Admission, ProviderSnapshot, Snapshot, TenantSnapshot
from iop_edge.status import OverloadStatus
from iop_wire import HEALTH_STATES

#: Per-provider gauges: metric name suffix, help text, and how to read it from a ProviderSnapshot.
_PROVIDER_GAUGES: Final[tuple[tuple[str, str, Callable[[ProviderSnapshot], float]], ...]] = (
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
        "revoked_in_flight",
        "Revoked leases whose bodies still run: counted against capacity until they leave.",
        lambda p: p.revoked_in_flight,
    ),
    (
        "revoked_long_in_flight",
        "Revoked long-context leases whose bodies still run.",
        lambda p: p.revoked_long_in_flight,
    ),
    (
        "token_budget",
        "Context-token budget of a provider that admits by tokens (total_context_tokens); 0 if it admits by slots.",
        lambda p: p.token_budget or 0,
    ),
    (
        "reserved_tokens",
        "Context tokens reserved by the provider's leases not released yet (prompt plus max_tokens, settled).",
        lambda p: p.reserved_tokens,
    ),
    (
        "token_headroom",
        "Context tokens held for a big request passed over too often (0: none is).",
        lambda p: p.token_headroom,
    ),
    (
        "effective_token_budget",
        "Context-token budget admitted by now: token_budget less what the engine's own report cut; 0 if it admits by slots.",
        lambda p: p.effective_token_budget or 0,
    ),
    (
        "engine_kv_tokens",
        "The engine's own KV-cache use as its node last reported it, in the budget's tokens "
        "(kv_use times token_budget; beside iop_reserved_tokens); 0 without a budget or a report.",
        lambda p: round((p.reported_kv_use or 0.0) * (p.token_budget or 0)),
    ),
    (
        "engine_preemptions",
        "Sequences the engine preempted since it started, as its node last reported (0: not reported).",
        lambda p: p.reported_preemptions or 0,
    ),
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


class Reading(NamedTuple):
    """What the scrape-time collectors read, taken on the event loop (see :meth:`EdgeMetrics.render_off_loop`)."""

    snapshot: Snapshot
    models: tuple[str, ...]
    front_door: OverloadStatus | None


#: Set around a render in a worker thread: the collectors read it instead of live state.
READING: contextvars.ContextVar[Reading | None] = contextvars.ContextVar("iop_metrics_reading", default=None)


@final
class SnapshotCollector(Collector):
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
        reading = READING.get()
        if reading is None:
            reading = Reading(self._admission.snapshot(), tuple(self._admission.config.models), None)
        return self._families(reading)

    def _families(self, reading: Reading | None) -> Iterator[Metric]:
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
    yield _reported_family(providers, level)
    panic = GaugeMetricFamily(
        "iop_panic_mode",
        "1 while every eligible candidate of the model is ejected and requests go to them anyway, else 0.",
        labels=("model",),
    )
    if snap is not None:
        for model in models:
            panic.add_metric((model,), int(model in snap.panic))
    yield panic


#: The states a node reports of a provider ([health-probe]); ``none``: no report on its connection yet.
REPORTED_STATES: Final = (*HEALTH_STATES, "none")


def _reported_family(providers: Iterable[ProviderSnapshot], level: Level) -> Metric:
    """``iop_health_reported``: per provider 1 at the state its node last reported, 0 at the others
    (per node or Edge-wide: how many providers are in each state)."""
    family = GaugeMetricFamily(
        "iop_health_reported",
        "1 at the state the provider's node last reported of it on its connection "
        "(ready, not_ready, stalled; none before a report), else 0.",
        labels=(*_LABELS[level], "state"),
    )
    counts: dict[tuple[str, ...], dict[str, int]] = {}
    for p in providers:
        by_state = counts.setdefault(_where(level, p), dict.fromkeys(REPORTED_STATES, 0))
        by_state[p.reported or "none"] += 1
    for where, by_state in counts.items():
        for state, count in by_state.items():
            family.add_metric((*where, state), count)
    return family


@final
class FrontDoorCollector(Collector):
    """The front door's figures (``FrontDoor.status()``), read at every scrape."""

    def __init__(self, read: Callable[[], OverloadStatus]) -> None:
        self._read = read

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        reading = READING.get()
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

"""Per-provider snapshot figures read from the core: every field of each row, the status and
health words, the effective capacities, candidate pressure (queued waiters and queued retries),
the ejection time left, and the ``first``/``count`` window; ``provider_rows`` is the same data as
plain dicts."""

from __future__ import annotations

import attrs
import pytest
from tests.admission.steps import as_lease as _lease
from tests.admission.steps import as_waiter as _waiter

from iop_admission import (
    PROVIDER_FIELDS,
    Admission,
    ModelGroup,
    OutlierPolicy,
    PoolConfig,
    ProviderKey,
    ProviderSnapshot,
    QueuePolicy,
)
from iop_admission.core import AdmissionState

BIG = "ornith:35b"
FAST = "ornith-fast"
GPU2 = ProviderKey("node-c", "gpu2")


def _three(pool, **gpu2: object) -> PoolConfig:
    """gpu0 (3 slots, 2 long, priority 2), gpu1 (2 slots, no long slot, priority 1) and gpu2
    (disabled unless told), all three candidates of BIG; FAST on gpu0 only."""
    return PoolConfig(
        policy=QueuePolicy(max_queue=64, queue_timeout=30.0),
        providers={
            pool.gpu0: pool.spec(3, 2, priority=2),
            pool.gpu1: pool.spec(2, 0, priority=1),
            GPU2: pool.spec(**({"capacity": 4, "long_cap": 1, "enabled": False} | gpu2)),
        },
        models={BIG: ModelGroup(candidates=(pool.gpu0, pool.gpu1, GPU2)), FAST: ModelGroup(candidates=(pool.gpu0,))},
    )


def test_rows_of_an_idle_pool_give_status_health_and_effective_capacities(pool):
    """Connected and enabled: available, online, full effective capacities; connected but
    disabled: disabled, online, effective 0; not connected: unavailable, offline, effective 0."""
    core = AdmissionState(_three(pool))
    core.connect("node-a")
    core.connect("node-a")
    core.connect("node-c")
    rows = core.provider_rows()
    assert rows == [
        {
            "node_id": "node-a",
            "provider_id": "gpu0",
            "connected": True,
            "status": "available",
            "health": "online",
            "generation": 2,
            "capacity": 3,
            "long_context_capacity": 2,
            "effective_capacity": 3,
            "effective_long_capacity": 2,
            "in_flight": 0,
            "long_in_flight": 0,
            "queued": 0,
            "long_queued": 0,
            "priority": 2,
            "failures": 0,
            "ejection_left": 0.0,
            "ejections": 0,
            "probes": 0,
            "revoked_in_flight": 0,
            "revoked_long_in_flight": 0,
            "token_budget": None,
            "reserved_tokens": 0,
            "token_headroom": 0,
            "reported": "",
            "report_reason": "",
            "reported_capacity": None,
            "effective_token_budget": None,
            "reported_kv_use": None,
            "reported_preemptions": None,
        },
        {
            "node_id": "node-b",
            "provider_id": "gpu1",
            "connected": False,
            "status": "unavailable",
            "health": "offline",
            "generation": 0,
            "capacity": 2,
            "long_context_capacity": 0,
            "effective_capacity": 0,
            "effective_long_capacity": 0,
            "in_flight": 0,
            "long_in_flight": 0,
            "queued": 0,
            "long_queued": 0,
            "priority": 1,
            "failures": 0,
            "ejection_left": 0.0,
            "ejections": 0,
            "probes": 0,
            "revoked_in_flight": 0,
            "revoked_long_in_flight": 0,
            "token_budget": None,
            "reserved_tokens": 0,
            "token_headroom": 0,
            "reported": "",
            "report_reason": "",
            "reported_capacity": None,
            "effective_token_budget": None,
            "reported_kv_use": None,
            "reported_preemptions": None,
        },
        {
            "node_id": "node-c",
            "provider_id": "gpu2",
            "connected": True,
            "status": "disabled",
            "health": "online",
            "generation": 1,
            "capacity": 4,
            "long_context_capacity": 1,
            "effective_capacity": 0,
            "effective_long_capacity": 0,
            "in_flight": 0,
            "long_in_flight": 0,
            "queued": 0,
            "long_queued": 0,
            "priority": 0,
            "failures": 0,
            "ejection_left": 0.0,
            "ejections": 0,
            "probes": 0,
            "revoked_in_flight": 0,
            "revoked_long_in_flight": 0,
            "token_budget": None,
            "reserved_tokens": 0,
            "token_headroom": 0,
            "reported": "",
            "report_reason": "",
            "reported_capacity": None,
            "effective_token_budget": None,
            "reported_kv_use": None,
            "reported_preemptions": None,
        },
    ]
    assert list(rows[0]) == list(PROVIDER_FIELDS)
    assert core.provider_snapshots() == tuple(ProviderSnapshot(**row) for row in rows)


def test_disabled_provider_whose_node_is_offline_reads_disabled_and_offline(pool):
    core = AdmissionState(_three(pool))
    [row] = core.provider_rows(first=2)
    assert (row["status"], row["health"], row["connected"]) == ("disabled", "offline", False)


def test_candidate_pressure_counts_waiters_and_queued_retries_at_eligible_candidates(pool):
    """Queued BIG waiters count at every eligible candidate (long ones only where a long slot
    exists); FAST's only at gpu0; a queued retry counts at its untried eligible candidates only;
    a provider not eligible shows no pressure."""
    core = AdmissionState(_three(pool, enabled=True))
    for node in ("node-a", "node-b", "node-c"):
        core.connect(node)
    held = [_lease(core.request(BIG, False, 0.0)) for _ in range(9)]
    assert [lease.provider for lease in held].count(GPU2) == 4
    _waiter(core.request(BIG, False, 1.0))
    _waiter(core.request(BIG, True, 1.0))
    _waiter(core.request(FAST, False, 1.0))
    _waiter(core.request(FAST, True, 1.0))
    on_gpu0 = next(lease for lease in held if lease.provider == pool.gpu0)
    core.release(on_gpu0)  # gpu0's slot goes to the first waiter; the lease then retries
    retried = _waiter(core.retry(on_gpu0, 2.0))
    assert retried.candidates == (pool.gpu1, GPU2)
    figures = [(r["queued"], r["long_queued"]) for r in core.provider_rows()]
    # gpu0: BIG long + FAST normal + FAST long (the BIG normal waiter was granted);
    # gpu1: BIG normal waiter granted, the long one cannot run there, + the retry;
    # gpu2: the BIG long waiter + the retry.
    assert figures == [(3, 2), (1, 0), (2, 1)]
    # A second queued retry (gpu1 tried) counts at gpu0 and gpu2, not at gpu1.
    on_gpu1 = next(lease for lease in held if lease.provider == pool.gpu1)
    _waiter(core.retry(on_gpu1, 2.0))
    assert [(r["queued"], r["long_queued"]) for r in core.provider_rows()] == [(4, 2), (1, 0), (3, 1)]
    core.disconnect("node-c", 1)
    assert [(r["queued"], r["long_queued"]) for r in core.provider_rows()][2] == (0, 0)


def test_long_retry_pressure_skips_candidates_without_long_slots(pool):
    core = AdmissionState(_three(pool, enabled=True))
    for node in ("node-a", "node-b", "node-c"):
        core.connect(node)
    long_leases = [_lease(core.request(BIG, True, 0.0)) for _ in range(3)]
    assert [lease.provider for lease in long_leases] == [pool.gpu0, pool.gpu0, GPU2]
    core.release(long_leases[0])
    filler = _lease(core.request(BIG, True, 0.0))
    assert filler.provider == pool.gpu0
    retried = _waiter(core.retry(long_leases[0], 1.0))
    assert retried.long and retried.candidates == (pool.gpu1, GPU2)
    assert [(r["queued"], r["long_queued"]) for r in core.provider_rows()] == [(0, 0), (0, 0), (1, 1)]


def test_ejection_figures_and_the_window_of_rows(pool):
    """failures, ejections and probes are the provider's totals; ejection_left counts from the
    latest time passed in or from ``now``, never below 0, and is 0 once the probe is due;
    ``first``/``count`` pick providers by position."""
    config = attrs.evolve(_three(pool), outlier=OutlierPolicy(2, 5.0, 60.0))
    core = AdmissionState(config)
    core.connect("node-a")
    for t in (0.0, 1.0):
        lease = _lease(core.request(FAST, False, t))
        core.release(lease)
        core.report_failure(lease, t)
    [row] = core.provider_rows(count=1)
    assert (row["health"], row["failures"], row["ejection_left"], row["ejections"], row["probes"]) == (
        "ejected",
        2,
        5.0,
        1,
        0,
    )
    assert core.provider_rows(now=4.0, count=1)[0]["ejection_left"] == 2.0
    assert core.provider_rows(now=9.0, count=1)[0]["ejection_left"] == 0.0
    assert core.provider_snapshots(now=2.5, count=1)[0].ejection_left == 3.5
    core.advance(6.0)
    probe = _lease(core.request(FAST, False, 6.0))
    assert probe.probe
    [row] = core.provider_rows(count=1)
    assert (row["health"], row["ejection_left"], row["probes"]) == ("ejected", 0.0, 1)
    core.release(probe)
    core.report_success(probe, 6.0)
    [row] = core.provider_rows(count=1)
    assert (row["health"], row["failures"], row["ejections"], row["probes"]) == ("online", 0, 1, 1)
    assert [r["provider_id"] for r in core.provider_rows(first=1)] == ["gpu1", "gpu2"]
    assert [r["provider_id"] for r in core.provider_rows(first=1, count=1)] == ["gpu1"]
    assert [p.provider_id for p in core.provider_snapshots(first=1, count=1)] == ["gpu1"]
    assert core.provider_rows(first=3) == []


@pytest.mark.parametrize("held_long", [0, 1])
def test_in_flight_figures_count_leases_and_runs_held_elsewhere(pool, held_long):
    core = AdmissionState(_three(pool))
    core.connect("node-a")
    _lease(core.request(FAST, True, 0.0))
    core.hold(pool.gpu0, 1, held_long)
    [row] = core.provider_rows(count=1)
    assert (row["in_flight"], row["long_in_flight"]) == (2, 1 + held_long)


def test_snapshot_provider_matches_node_and_provider_both(pool):
    """Snapshot.provider needs both ids to match; a pair not configured is a KeyError naming it."""
    snap = Admission(pool.two_nodes()).snapshot()
    assert snap.provider("node-b", "gpu1").provider_id == "gpu1"
    with pytest.raises(KeyError) as caught:
        snap.provider("node-a", "gpu1")
    assert caught.value.args == ("node-a/gpu1",)
    with pytest.raises(KeyError):
        snap.provider("node-b", "gpu0")

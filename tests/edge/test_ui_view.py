"""The queue page's view model: snapshot -> view, reasons, positions, aggregation.

[queue-page]
"""

from __future__ import annotations

import json

import pytest

from iop_admission import ModelGroup, ProviderKey, ProviderSnapshot, Snapshot, WaiterSnapshot
from iop_edge._ui_view import REASONS, ViewFilter, ViewLimits, build_view, health_of, wait_reason

BIG = "ornith:35b"
FAST = "ornith-fast"
GPU0 = ProviderKey("node-a", "gpu0")
GPU1 = ProviderKey("node-b", "gpu1")


def provider(
    key: ProviderKey,
    *,
    capacity: int = 1,
    long_cap: int = 1,
    in_flight: int = 0,
    long_in_flight: int = 0,
    health: str = "online",
    status: str = "available",
    ejection_left: float = 0.0,
) -> ProviderSnapshot:
    live = health == "online" and status == "available"
    return ProviderSnapshot(
        node_id=key.node_id,
        provider_id=key.provider_id,
        connected=health != "offline",
        status=status,
        health=health,
        generation=1,
        capacity=capacity,
        long_context_capacity=long_cap,
        effective_capacity=capacity if live else 0,
        effective_long_capacity=long_cap if live else 0,
        in_flight=in_flight,
        long_in_flight=long_in_flight,
        queued=0,
        long_queued=0,
        priority=0,
        ejection_left=ejection_left,
    )


def snapshot(*providers: ProviderSnapshot, depth: int = 0) -> Snapshot:
    return Snapshot(queue_depth=depth, max_queue=64, queue_timeout=30.0, events_dropped=0, providers=providers)


def waiter(order: int, position: int, model: str = BIG, *, long: bool = False, age: float = 1.0) -> WaiterSnapshot:
    candidates = (GPU0, GPU1) if model == BIG else (GPU0,)
    return WaiterSnapshot(order, order, position, model, long, age, 1, candidates)


MODELS = {BIG: ModelGroup(candidates=(GPU0, GPU1)), FAST: ModelGroup(candidates=(GPU0,))}


@pytest.mark.req("queue-page")
@pytest.mark.parametrize(
    ("gpu0", "gpu1", "long", "reason"),
    [
        ({"in_flight": 1}, {"in_flight": 1}, False, "all_candidates_full"),
        ({"in_flight": 1}, {"health": "offline"}, False, "all_candidates_full"),
        ({"capacity": 2, "in_flight": 1, "long_in_flight": 1}, {"in_flight": 1}, True, "long_slot_taken"),
        ({"capacity": 2, "in_flight": 1, "long_in_flight": 1}, {"in_flight": 1}, False, "earlier_request_first"),
        ({"health": "offline"}, {"health": "ejected", "ejection_left": 3.0}, False, "no_live_candidate"),
        ({"status": "disabled"}, {"status": "unavailable"}, False, "no_live_candidate"),
    ],
)
def test_wait_reason(gpu0, gpu1, long, reason):
    """[queue-page] every candidate full, a long-context slot taken, no live candidate,
    an earlier request first: from the candidates' counters alone."""
    assert wait_reason([provider(GPU0, **gpu0), provider(GPU1, **gpu1)], long) == reason
    assert reason in REASONS


@pytest.mark.req("queue-page")
def test_health_of_names_disabled_and_unavailable():
    """[queue-page] disabled wins over the connection; a connected node may say unavailable."""
    assert health_of(provider(GPU0, status="disabled", health="offline")) == "disabled"
    assert health_of(provider(GPU0, status="unavailable")) == "unavailable"
    assert health_of(provider(GPU0, health="ejected")) == "ejected"
    assert health_of(provider(GPU0)) == "online"


@pytest.mark.req("queue-page")
def test_view_of_a_small_fleet():
    """[queue-page] providers, model keys with waiting and oldest wait, waiters with position,
    tenant and reason; it is plain JSON."""
    snap = snapshot(provider(GPU0, in_flight=1), provider(GPU1, health="ejected", ejection_left=4.26), depth=3)
    waiters = (waiter(1, 1, age=5.0), waiter(2, 1, FAST, age=2.0), waiter(3, 2, age=1.0))
    view = json.loads(json.dumps(build_view(snap, waiters, MODELS)))
    assert view["totals"] == {
        "queue_depth": 3,
        "max_queue": 64,
        "queue_timeout": 30.0,
        "providers": 2,
        "in_flight": 1,
        "capacity": 1,
        "health": {"online": 1, "offline": 0, "ejected": 1, "unavailable": 0, "disabled": 0},
    }
    rows = view["providers"]["rows"]
    assert [(r["node"], r["health"], r["in_flight"], r["ejection_left"]) for r in rows] == [
        ("node-a", "online", 1, 0.0),
        ("node-b", "ejected", 0, 4.3),
    ]
    models = {m["model"]: m for m in view["models"]}
    assert (models[BIG]["waiting"], models[BIG]["oldest_wait"], models[BIG]["candidates"]) == (
        2,
        5.0,
        ["node-a/gpu0", "node-b/gpu1"],
    )
    assert (models[FAST]["waiting"], models[FAST]["live_candidates"]) == (1, 1)
    assert [(w["order"], w["position"], w["model"], w["tenant"], w["reason"]) for w in view["waiters"]["rows"]] == [
        (1, 1, BIG, "default", "all_candidates_full"),
        (2, 1, FAST, "default", "all_candidates_full"),
        (3, 2, BIG, "default", "all_candidates_full"),
    ]
    assert view["waiters"]["by_reason"] == {"all_candidates_full": 3}


@pytest.mark.req("queue-page")
def test_large_fleet_is_aggregated_within_the_limits():
    """[queue-page] 10,000 providers and 10,000 waiters: totals over all, rows capped, the rest counted."""
    keys = [ProviderKey(f"node-{i:05d}", "gpu0") for i in range(10_000)]
    providers = tuple(
        provider(k, in_flight=1, health="offline" if i % 10 == 0 else "online") for i, k in enumerate(keys)
    )
    candidates = tuple(keys)  # as the core hands them: one tuple per model key
    models = {BIG: ModelGroup(candidates=candidates)}
    waiters = tuple(WaiterSnapshot(i, i, i, BIG, False, 0.5, 1, candidates) for i in range(1, 10_001))
    pauses: list[None] = []
    view = build_view(
        snapshot(*providers, depth=10_000),
        waiters,
        models,
        limits=ViewLimits(providers=50, waiters=20),
        pause=lambda: pauses.append(None),
    )
    assert len(pauses) >= 10  # a builder in a worker thread lets the loop in as it goes
    assert view["totals"]["health"]["offline"] == 1000
    assert view["totals"]["in_flight"] == 10_000
    assert (len(view["providers"]["rows"]), view["providers"]["matched"], view["providers"]["left_out"]) == (
        50,
        10_000,
        9_950,
    )
    assert (len(view["waiters"]["rows"]), view["waiters"]["left_out"]) == (20, 9_980)
    assert view["waiters"]["by_reason"] == {"all_candidates_full": 10_000}
    assert view["models"][0]["candidates"] == [str(k) for k in keys[:8]]
    assert view["models"][0]["candidate_count"] == 10_000


@pytest.mark.req("queue-page")
def test_filters_by_node_model_and_health():
    """[queue-page] a node substring, a model key and a health narrow every table."""
    snap = snapshot(provider(GPU0, in_flight=1), provider(GPU1, health="offline"), depth=2)
    waiters = (waiter(1, 1), waiter(2, 1, FAST))
    view = build_view(snap, waiters, MODELS, wanted=ViewFilter(model=FAST))
    assert [r["node"] for r in view["providers"]["rows"]] == ["node-a"]
    assert [m["model"] for m in view["models"]] == [FAST]
    assert [w["model"] for w in view["waiters"]["rows"]] == [FAST]
    view = build_view(snap, waiters, MODELS, wanted=ViewFilter(node="node-b"))
    assert [r["node"] for r in view["providers"]["rows"]] == ["node-b"]
    assert [w["model"] for w in view["waiters"]["rows"]] == [BIG]
    view = build_view(snap, waiters, MODELS, wanted=ViewFilter(health="offline"))
    assert [r["node"] for r in view["providers"]["rows"]] == ["node-b"]
    assert view["providers"]["left_out"] == 0

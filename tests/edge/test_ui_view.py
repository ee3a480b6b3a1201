"""The queue page's view model: snapshot -> view, reasons, positions, aggregation.

[queue-page]
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from iop_admission import (
    Admission,
    ModelGroup,
    PoolConfig,
    ProviderKey,
    ProviderSnapshot,
    ProviderSpec,
    QueuePolicy,
    Snapshot,
    TenantSpec,
    WaiterSnapshot,
)
from iop_edge.ui.view import REASONS, ViewFilter, ViewLimits, build_view, health_of, wait_reason
from iop_io import run_in_turns

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


@pytest.mark.req("queue-page", "health-probe")
def test_a_providers_row_carries_what_its_node_reported():
    """The node's last report of the backend (state, reason, the backend's own capacity) rides on
    the provider's row; a provider with no report carries "" and None."""
    stalled = attrs.evolve(
        provider(GPU1, capacity=4, health="ejected", ejection_left=2.0),
        reported="stalled",
        report_reason="no byte from the backend for 6.0 s",
        reported_capacity=2,
    )
    rows = build_view(snapshot(provider(GPU0), stalled), (), MODELS)["providers"]["rows"]
    assert [(r["reported"], r["report_reason"], r["reported_capacity"]) for r in rows] == [
        ("", "", None),
        ("stalled", "no byte from the backend for 6.0 s", 2),
    ]


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
        "nodes": 2,
        "offline_nodes": 0,
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
    assert view["tenants"] == []  # no tenants configured: no tenant table, no tenant reasons
    assert set(view["reasons"]) == set(REASONS) - {"tenant_quota", "higher_band_ahead"}


@pytest.mark.req("queue-page")
async def test_large_fleet_is_aggregated_within_the_limits(loop_turns):
    """[queue-page] 10,000 providers and 10,000 waiters: totals over all, rows capped, the rest counted;
    a builder run in turns with the loop gives it turns as it goes (iop_io.yield_to_loop)."""
    keys = [ProviderKey(f"node-{i:05d}", "gpu0") for i in range(10_000)]
    providers = tuple(
        provider(k, in_flight=1, health="offline" if i % 10 == 0 else "online") for i, k in enumerate(keys)
    )
    candidates = tuple(keys)  # as the core hands them: one tuple per model key
    models = {BIG: ModelGroup(candidates=candidates)}
    waiters = tuple(WaiterSnapshot(i, i, i, BIG, False, 0.5, 1, candidates) for i in range(1, 10_001))
    with trio.fail_after(30):
        view = await run_in_turns(
            lambda: build_view(
                snapshot(*providers, depth=10_000), waiters, models, limits=ViewLimits(providers=50, waiters=20)
            )
        )
    assert loop_turns.count >= 10  # a builder in a worker thread lets the loop in as it goes
    assert view["totals"]["health"]["offline"] == 1000
    assert (view["totals"]["nodes"], view["totals"]["offline_nodes"]) == (10_000, 1000)
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


TENANTS = (
    TenantSpec("gold", priority=1),
    TenantSpec("team-a", max_in_flight=1),
    TenantSpec("team-b", weight=2.0),
)


def tenant_pool() -> PoolConfig:
    """One provider of capacity 2 serving model key ``m``, and three tenants: ``gold`` in a
    higher band, ``team-a`` capped at one request in flight, ``team-b``."""
    window = 32768
    return PoolConfig(
        policy=QueuePolicy(max_queue=100, queue_timeout=1e9),
        providers={
            GPU0: ProviderSpec(
                capacity=2, long_context_capacity=1, context_window_tokens=window, total_context_tokens=window
            )
        },
        models={"m": ModelGroup(candidates=(GPU0,))},
        tenants=TENANTS,
    )


def views_of_a_tenant_pool(wanted: ViewFilter | None = None) -> list[dict[str, Any]]:
    """Run the real admission core with tenants: team-a and team-b each hold a lease (the
    provider is full, team-a at its quota), then team-a, team-b and gold queue, in that order.
    The view of that instant; then team-b's lease ends and the view again."""
    views: list[dict[str, Any]] = []

    async def main() -> None:
        adm = Admission(tenant_pool())
        adm.connect(GPU0.node_id)
        end = {name: trio.Event() for name in ("team-a", "team-b")}

        async def request(tenant: str, done: trio.Event | None = None) -> None:
            async with adm.lease("m", tenant=tenant):
                if done is not None:
                    await done.wait()

        async with trio.open_nursery() as nursery:
            for name, done in end.items():
                nursery.start_soon(request, name, done)
                await trio.testing.wait_all_tasks_blocked()
            for name in ("team-a", "team-b", "gold"):
                nursery.start_soon(request, name, trio.Event())  # held until cancelled
                await trio.testing.wait_all_tasks_blocked()
            views.append(build_view(adm.snapshot(), adm.waiters(), adm.config.models, wanted=wanted or ViewFilter()))
            end["team-b"].set()
            await trio.testing.wait_all_tasks_blocked()
            views.append(build_view(adm.snapshot(), adm.waiters(), adm.config.models, wanted=wanted or ViewFilter()))
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return views


@pytest.mark.req("queue-page")
def test_waiters_show_their_tenant_and_the_tenant_reasons():
    """[queue-page] from the core's own snapshot with tenants: a request held by its tenant's
    quota, one behind a higher band, one of the higher band waiting for a full provider; when a
    slot frees the higher band is granted and the reasons follow."""
    before, after = views_of_a_tenant_pool()
    rows = [(w["order"], w["position"], w["tenant"], w["reason"]) for w in before["waiters"]["rows"]]
    assert rows == [
        (1, 1, "team-a", "tenant_quota"),
        (2, 2, "team-b", "higher_band_ahead"),
        (3, 3, "gold", "all_candidates_full"),
    ]
    assert before["waiters"]["by_reason"] == {
        "tenant_quota": 1,
        "higher_band_ahead": 1,
        "all_candidates_full": 1,
    }
    rows = [(w["position"], w["tenant"], w["reason"]) for w in after["waiters"]["rows"]]
    assert rows == [(1, "team-a", "tenant_quota"), (2, "team-b", "all_candidates_full")]
    assert set(before["reasons"]) == set(REASONS)


@pytest.mark.req("queue-page")
def test_tenant_table_has_band_weight_waiting_in_flight_and_share():
    """[queue-page] one row per tenant, by name only: band, weight, quotas, waiting, in flight
    and the share of recent grants."""
    before, after = views_of_a_tenant_pool()
    table = {t["tenant"]: t for t in before["tenants"]}
    assert list(table) == ["gold", "team-a", "team-b", "default"]
    cells = {
        name: (t["band"], t["weight"], t["waiting"], t["in_flight"], t["max_in_flight"]) for name, t in table.items()
    }
    assert cells == {
        "gold": (1, 1.0, 1, 0, None),
        "team-a": (0, 1.0, 1, 1, 1),
        "team-b": (0, 2.0, 1, 1, None),
        "default": (0, 1.0, 0, 0, None),
    }
    assert (table["team-a"]["share"], table["team-b"]["share"], table["gold"]["share"]) == (0.5, 0.5, 0.0)
    table = {t["tenant"]: t for t in after["tenants"]}
    assert (table["gold"]["waiting"], table["gold"]["in_flight"], table["team-b"]["in_flight"]) == (0, 1, 0)
    assert table["gold"]["share"] == pytest.approx(1 / 3, abs=0.001)


@pytest.mark.req("queue-page")
def test_filter_by_tenant_narrows_the_waiters_only():
    """[queue-page] ?tenant= keeps that tenant's waiters; the providers and the tenant table stay whole."""
    before, _ = views_of_a_tenant_pool(wanted=ViewFilter(tenant="team-b"))
    assert [(w["tenant"], w["reason"]) for w in before["waiters"]["rows"]] == [("team-b", "higher_band_ahead")]
    assert before["waiters"]["matched"] == 1
    assert len(before["tenants"]) == 4
    assert len(before["providers"]["rows"]) == 1

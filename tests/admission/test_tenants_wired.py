"""Tenants wired into the admission core: ``PoolConfig.tenants``, ``request(tenant=, cost=)``, ``settle``.

Sans-I/O tests of :class:`AdmissionState` with exact steps, the trio and
asyncio layers' ``lease(tenant=...)``, and a differential Hypothesis test:
with one configured tenant every decision is the one of no tenants (today's
global FIFO) over the same random traces.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from iop_admission import (
    Admission,
    ModelGroup,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    QueueFull,
    QueuePolicy,
    TenantLimitExceeded,
    TenantSpec,
)
from iop_admission.aio import AsyncAdmission
from iop_admission.core import AdmissionState, Failed, Granted, Lease, Waiter

A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-b", "gpu1")
WINDOW = 32768


def spec(capacity: int, long_cap: int = 1) -> ProviderSpec:
    return ProviderSpec(
        capacity=capacity,
        long_context_capacity=long_cap,
        context_window_tokens=WINDOW,
        total_context_tokens=WINDOW * long_cap,
    )


def config(
    tenants: tuple[TenantSpec, ...] = (), *, capacity: int = 4, max_queue: int = 100_000, two: bool = False
) -> PoolConfig:
    providers = {A: spec(capacity)}
    models = {"m": ModelGroup(candidates=(A,))}
    if two:
        providers[B] = spec(capacity)
        models["n"] = ModelGroup(candidates=(B,))
    return PoolConfig(
        policy=QueuePolicy(max_queue=max_queue, queue_timeout=1e9),
        providers=providers,
        models=models,
        tenants=tenants,
    )


def started(cfg: PoolConfig) -> AdmissionState:
    state = AdmissionState(cfg)
    for node in state.nodes():
        state.connect(node)
    return state


def flood(state: AdmissionState, tenant: str, n: int, model: str = "m", cost: float = 1.0) -> list[Lease | Waiter]:
    return [state.request(model, False, 0.0, tenant, cost) for _ in range(n)]


def granted(decisions: list[object]) -> list[Lease]:
    return [d.lease for d in decisions if isinstance(d, Granted)]


@pytest.mark.req("tenant-fair-share")
def test_weights_1_1_2_share_a_flooded_provider_25_25_50() -> None:
    state = started(config((TenantSpec("a"), TenantSpec("b"), TenantSpec("c", weight=2))))
    live: list[Lease] = []
    for name in ("a", "b", "c"):
        for r in flood(state, name, 5000):
            if isinstance(r, Lease):
                live.append(r)
    served: Counter[str] = Counter()
    for _ in range(8000):
        lease = live.pop(0)
        for new in granted(state.release(lease)):
            served[new.tenant] += 1
            live.append(new)
    total = sum(served.values())
    assert total == 8000
    assert abs(served["a"] / total - 0.25) <= 0.02
    assert abs(served["b"] / total - 0.25) <= 0.02
    assert abs(served["c"] / total - 0.50) <= 0.02
    rows = {row.name: row for row in state.tenant_snapshots()}
    assert rows["c"].weight == 2 and rows["c"].in_flight + rows["a"].in_flight + rows["b"].in_flight == 4
    assert abs(rows["c"].share - 0.5) <= 0.02
    assert rows["a"].waiting + rows["b"].waiting + rows["c"].waiting == state.queue_depth


@pytest.mark.req("tenant-fair-share")
def test_a_higher_band_is_served_first_and_an_idle_tenant_banks_no_credit() -> None:
    state = started(config((TenantSpec("low"), TenantSpec("high", priority=1), TenantSpec("idle")), capacity=1))
    first = state.request("m", False, 0.0, "low")
    assert isinstance(first, Lease)
    flood(state, "low", 5)
    high = state.request("m", False, 0.0, "high")
    assert isinstance(high, Waiter)
    (lease,) = granted(state.release(first))
    assert lease.tenant == "high"
    # "low" served 1 while "idle" was idle: "idle" now alternates with "low", it does not catch up.
    order = []
    flood(state, "idle", 5)
    for _ in range(6):
        (lease,) = granted(state.release(lease))
        order.append(lease.tenant)
    assert order.count("idle") == 3 and order.count("low") == 3


@pytest.mark.req("tenant-fair-share")
def test_a_tenant_blocked_on_one_model_does_not_block_another_on_another_model() -> None:
    state = started(config((TenantSpec("a"), TenantSpec("b")), capacity=1, two=True))
    hold_m = state.request("m", False, 0.0, "a")
    hold_n = state.request("n", False, 0.0, "b")
    assert isinstance(hold_m, Lease) and isinstance(hold_n, Lease)
    waiting_a = state.request("m", False, 0.0, "a")  # a waits for m
    waiting_b = state.request("n", False, 0.0, "b")  # b waits for n
    assert isinstance(waiting_a, Waiter) and isinstance(waiting_b, Waiter)
    (lease,) = granted(state.release(hold_n))
    assert lease.tenant == "b" and lease.model == "n"  # a's blocked head does not hold b back


@pytest.mark.req("tenant-quotas")
def test_max_in_flight_holds_across_providers_and_a_release_wakes_the_tenant_elsewhere() -> None:
    state = started(config((TenantSpec("a", max_in_flight=2), TenantSpec("b")), capacity=4, two=True))
    one = state.request("m", False, 0.0, "a")
    two = state.request("n", False, 0.0, "a")
    assert isinstance(one, Lease) and isinstance(two, Lease)
    third = state.request("n", False, 0.0, "a")
    assert isinstance(third, Waiter)  # n has room, but a is at its max_in_flight
    other = state.request("n", False, 0.0, "b")
    assert isinstance(other, Lease)  # b is not held back by a's cap
    (lease,) = granted(state.release(one))  # a frees a slot on m: its waiter for n runs
    assert lease.tenant == "a" and lease.model == "n"
    assert {row.name: row.in_flight for row in state.tenant_snapshots()}["a"] == 2


@pytest.mark.req("tenant-quotas")
def test_max_queue_refuses_the_tenant_only_and_names_the_limit() -> None:
    state = started(config((TenantSpec("a", max_queue=2), TenantSpec("b")), capacity=1))
    flood(state, "a", 3)  # 1 granted, 2 queued
    with pytest.raises(TenantLimitExceeded) as caught:
        state.request("m", False, 0.0, "a")
    assert (caught.value.tenant, caught.value.limit, caught.value.value) == ("a", "max_queue", 2)
    assert isinstance(state.request("m", False, 0.0, "b"), Waiter)


@pytest.mark.req("tenant-quotas")
def test_a_full_queue_sheds_the_lowest_negative_band_first() -> None:
    tenants = (TenantSpec("batch", priority=-1), TenantSpec("chat"), TenantSpec("bulk", priority=-2))
    state = started(config(tenants, capacity=1, max_queue=3))
    flood(state, "chat", 1)
    flood(state, "batch", 2)
    bulk = state.request("m", False, 0.0, "bulk")
    assert isinstance(bulk, Waiter) and state.queue_depth == 3
    chat = state.request("m", False, 0.0, "chat")  # full: the newest of the lowest band goes
    assert isinstance(chat, Waiter)
    (shed,) = state.drain_decisions()
    assert isinstance(shed, Failed) and shed.waiter is bulk
    assert isinstance(shed.error, TenantLimitExceeded) and shed.error.limit == "shed"
    assert state.drain_decisions() == []
    with pytest.raises(TenantLimitExceeded) as caught:
        state.request("m", False, 0.0, "bulk")  # nothing below -2 to shed
    assert caught.value.limit == "shed"
    state.request("m", False, 0.0, "chat")  # sheds a batch waiter
    state.request("m", False, 0.0, "chat")  # sheds the other
    with pytest.raises(QueueFull):
        state.request("m", False, 0.0, "chat")  # nothing sheddable left


@pytest.mark.req("tenant-token-cost")
def test_tokens_reserved_at_admission_are_settled_with_the_usage() -> None:
    state = started(config((TenantSpec("big"), TenantSpec("small")), capacity=1))
    lease = state.request("m", False, 0.0, "big", 8000.0)
    assert isinstance(lease, Lease) and lease.cost == 8000.0
    flood(state, "big", 40, cost=8000.0)
    flood(state, "small", 400, cost=500.0)
    used: Counter[str] = Counter()
    for _ in range(60):
        state.settle(lease, lease.cost * 0.9)
        used[lease.tenant] += lease.cost
        (lease,) = granted(state.release(lease))
    rows = {row.name: row for row in state.tenant_snapshots()}
    # Charged = used after settlement, plus the reserve of the one lease still running.
    assert rows["big"].cost_charged + rows["small"].cost_charged == pytest.approx(sum(used.values()) + lease.cost)
    # Equal weights: served tokens even out, not request counts.
    assert abs(used["big"] - used["small"]) <= 8000.0 + 500.0


@pytest.mark.req("tenant-fair-share")
def test_live_refresh_keeps_leases_and_waiters_and_follows_new_weights() -> None:
    state = started(config((TenantSpec("a"), TenantSpec("b")), capacity=2))
    live = [r for name in ("a", "b") for r in flood(state, name, 400) if isinstance(r, Lease)]
    depth = state.queue_depth
    state.refresh(config((TenantSpec("a", weight=3), TenantSpec("b")), capacity=2))
    assert state.queue_depth == depth and all(not lease.released for lease in live)
    served: Counter[str] = Counter()
    for _ in range(400):
        for new in granted(state.release(live.pop(0))):
            served[new.tenant] += 1
            live.append(new)
    assert abs(served["a"] / 400 - 0.75) <= 0.02
    state.refresh(config(capacity=2))  # tenants gone: one FIFO again, nothing lost
    assert state.queue_depth == depth - 400 and state.tenant_snapshots() == ()
    (next_lease,) = granted(state.release(live.pop(0)))
    assert next_lease.arrival == min(w.seq for w in state.waiters()) - 1 or next_lease.arrival < min(
        w.seq for w in state.waiters()
    )


@pytest.mark.req("tenant-fair-share")
def test_the_trio_layer_charges_leases_to_tenants_and_reports_them() -> None:
    adm = Admission(config((TenantSpec("a", max_in_flight=1), TenantSpec("b")), capacity=2))
    adm.connect("node-a")
    seen: list[str] = []

    async def main() -> None:
        async with adm.lease("m", tenant="a", cost=3.0) as lease:
            seen.append(lease.tenant)
            async with adm.lease("m", tenant="nobody") as other:
                seen.append(other.tenant)
            adm.settle(lease, 2.0)
            rows = {row.name: row for row in adm.snapshot().tenants}
            assert rows["a"].in_flight == 1 and rows["a"].cost_charged == 2.0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert seen == ["a", "default"]


@pytest.mark.req("tenant-fair-share")
def test_lease_events_carry_the_tenant_only_when_tenants_are_configured() -> None:
    async def kinds(cfg: PoolConfig) -> list[tuple[str, str | None]]:
        adm = Admission(cfg)
        async with adm.subscribe(buffer=16) as events:
            adm.connect("node-a")
            async with adm.lease("m", tenant="a"):
                pass
            out = []
            while True:
                try:
                    event = events.receive_nowait()
                except trio.WouldBlock:
                    return out
                out.append((event.kind, event.tenant))

    async def main() -> None:
        assert await kinds(config((TenantSpec("a"),))) == [
            ("connected", None),
            ("granted", "a"),
            ("released", "a"),
        ]
        assert await kinds(config()) == [("connected", None), ("granted", None), ("released", None)]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.req("tenant-fair-share")
def test_the_asyncio_layer_charges_leases_to_tenants() -> None:
    async def main() -> list[str]:
        adm = AsyncAdmission(config((TenantSpec("a"),), capacity=2))
        adm.connect("node-a")
        async with adm.lease("m", tenant="a", cost=5.0) as lease:
            adm.settle(lease, 4.0)
            rows = {row.name: row for row in adm.snapshot().tenants}
            assert rows["a"].cost_charged == 4.0
            return [lease.tenant]

    assert asyncio.run(main()) == ["a"]


# ------------------------------------------------------------ one tenant is today

STEP = st.one_of(
    st.tuples(st.just("request"), st.sampled_from(["m", "n"]), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 50), st.booleans()),
    st.tuples(st.just("withdraw"), st.integers(0, 50), st.booleans()),
    st.tuples(st.just("retry"), st.integers(0, 50), st.booleans()),
    st.tuples(st.just("disconnect"), st.sampled_from(["node-a", "node-b"]), st.booleans()),
    st.tuples(st.just("connect"), st.sampled_from(["node-a", "node-b"]), st.booleans()),
)


def _both_candidates(tenants: tuple[TenantSpec, ...]) -> PoolConfig:
    return PoolConfig(
        policy=QueuePolicy(max_queue=6, queue_timeout=1e9),
        providers={A: spec(2, 1), B: spec(1, 0)},
        models={"m": ModelGroup(candidates=(A, B)), "n": ModelGroup(candidates=(B,))},
        tenants=tenants,
    )


def _trace(tenants: tuple[TenantSpec, ...], steps: list[tuple[str, object, bool]]) -> list[object]:
    """Run ``steps``; every outcome as plain values (lease ids, providers, waiter numbers, errors)."""
    state = AdmissionState(_both_candidates(tenants))
    out: list[object] = [state.connect("node-a")[0], state.connect("node-b")[0]]
    leases: list[Lease] = []
    waiters: list[Waiter] = []

    def note(decisions: list[object]) -> None:
        for d in decisions:
            if isinstance(d, Granted):
                leases.append(d.lease)
                out.append(("granted", d.waiter.seq, d.lease.id, d.lease.provider))
            else:
                out.append(repr(d))

    for kind, arg, flag in steps:
        try:
            if kind == "request":
                r = state.request(str(arg), flag, 0.0)
                (leases if isinstance(r, Lease) else waiters).append(r)  # type: ignore[arg-type]
                out.append(repr(r))
            elif kind == "release" and leases:
                note(state.release(leases[int(str(arg)) % len(leases)]))  # type: ignore[arg-type]
            elif kind == "withdraw" and waiters:
                out.append(state.withdraw(waiters[int(str(arg)) % len(waiters)]))
            elif kind == "retry" and leases:
                lease = leases[int(str(arg)) % len(leases)]
                if not lease.released:  # a second retry raises: its error is the outcome compared
                    r = state.retry(lease, 0.0)
                    (leases if isinstance(r, Lease) else waiters).append(r)  # type: ignore[arg-type]
                    out.append(repr(r))
            elif kind == "disconnect":
                _ok, decisions = state.disconnect(str(arg), state.generation(str(arg)))
                note(decisions)  # type: ignore[arg-type]
            elif kind == "connect":
                note(state.connect(str(arg))[1])  # type: ignore[arg-type]
        except Exception as exc:  # the error itself is the outcome compared
            out.append(type(exc).__name__)
    out.append([repr(w) for w in state.waiters()])
    return out


@pytest.mark.req("tenant-one-is-today")
@settings(max_examples=300, deadline=None)
@given(st.lists(STEP, max_size=60))
def test_one_tenant_decides_exactly_as_no_tenants(steps: list[tuple[str, object, bool]]) -> None:
    assert _trace((TenantSpec("default"),), steps) == _trace((), steps)

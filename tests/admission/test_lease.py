"""Leases through the trio layer: provider-wide state, lifecycle, long slots,
cross-group wake-up and the Edge-wide queue policy.

[provider-state] [lease-lifecycle] [long-state] [cross-group-wakeup]
[queue-ownership] [cross-model-tests]
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iop_admission import (
    Admission,
    ConfigError,
    LeaseRevoked,
    ModelGroup,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    QueueFull,
    QueuePolicy,
    QueueTimeout,
    validate_pool,
)
from iop_admission.core import Lease, Waiter, WaiterState

BIG = "ornith:35b"
FAST = "ornith-fast"


# --------------------------------------------------------------- [provider-state]


@pytest.mark.req("provider-state")
async def test_provider_state_two_groups_share_capacity_one(autojump_clock, pool, spawn, drain_check):
    """[provider-state] ornith:35b and ornith-fast on capacity-1 gpu0: one holds, one waits."""
    adm = Admission(pool.shared())
    adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        a = await spawn(nursery, adm, BIG)
        b = await spawn(nursery, adm, FAST)
        assert a.lease is not None and a.lease.provider == pool.gpu0
        assert b.waiting
        snap = adm.snapshot()
        assert snap.queue_depth == 1
        assert snap.provider("node-a", "gpu0").in_flight == 1
        t0 = trio.current_time()
        a.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert b.lease is not None and b.lease.provider == pool.gpu0
        assert b.granted_at == t0
        assert adm.snapshot().queue_depth == 0
        assert adm.snapshot().provider("node-a", "gpu0").in_flight == 1
        b.release.set()
    assert a.lease.released and b.lease.released
    drain_check(adm)


# -------------------------------------------------------------- [lease-lifecycle]


@pytest.mark.req("lease-lifecycle")
async def test_lease_ids_unique_and_fields(autojump_clock, pool, drain_check):
    """[lease-lifecycle] every grant is a new lease with a unique id, released on exit."""
    adm = Admission(pool.shared(capacity=3, long_cap=1))
    gen = adm.connect("node-a")
    seen = []
    for model in (BIG, FAST, BIG, FAST):
        async with adm.lease(model) as lease:
            assert (lease.provider, lease.generation, lease.long, lease.model) == (
                pool.gpu0,
                gen,
                False,
                model,
            )
            assert not lease.released
            seen.append(lease)
        assert lease.released and not lease.revoked
    async with adm.lease(BIG, long=True) as a, adm.lease(FAST) as b, adm.lease(FAST) as c:
        assert a.long and not b.long
        seen += [a, b, c]
        assert adm.snapshot().provider("node-a", "gpu0").in_flight == 3
    assert len({lease.id for lease in seen}) == len(seen)
    drain_check(adm)


@pytest.mark.req("lease-lifecycle")
async def test_lease_released_on_exception_in_body(autojump_clock, pool, drain_check):
    """[lease-lifecycle] an exception in the body releases the lease once and propagates."""
    adm = Admission(pool.shared())
    adm.connect("node-a")
    with pytest.raises(KeyError, match="upstream"):
        async with adm.lease(BIG) as lease:
            raise KeyError("upstream")
    assert lease.released
    # The slot is really free: the other group gets it at once.
    async with adm.lease(FAST) as again:
        assert again.id != lease.id
    drain_check(adm)


@pytest.mark.req("lease-lifecycle")
async def test_cancel_while_waiting_leaves_queue(autojump_clock, pool, spawn, drain_check):
    """[lease-lifecycle] a waiter cancelled in the queue leaves it; nothing else changes."""
    adm = Admission(pool.shared())
    adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        waiter = await spawn(nursery, adm, FAST)
        assert adm.snapshot().queue_depth == 1
        waiter.scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert waiter.cancelled and waiter.lease is None
        snap = adm.snapshot()
        assert snap.queue_depth == 0
        assert snap.provider("node-a", "gpu0").queued == 0
        assert snap.provider("node-a", "gpu0").in_flight == 1
        holder.release.set()
    drain_check(adm)


@pytest.mark.req("lease-lifecycle")
async def test_cancel_while_holding_releases(autojump_clock, pool, spawn, drain_check):
    """[lease-lifecycle] cancelling the holder releases the lease and grants the next waiter."""
    adm = Admission(pool.shared())
    adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        waiter = await spawn(nursery, adm, FAST)
        holder.scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert holder.cancelled and holder.lease.released
        assert waiter.lease is not None
        waiter.release.set()
    drain_check(adm)


@pytest.mark.req("lease-lifecycle")
async def test_cancel_before_entry_changes_nothing(autojump_clock, pool, drain_check):
    """[lease-lifecycle] entering in an already-cancelled scope raises Cancelled, takes nothing."""
    adm = Admission(pool.shared())
    adm.connect("node-a")
    entered = False
    with trio.CancelScope() as scope:
        scope.cancel()
        async with adm.lease(BIG):
            entered = True
    assert scope.cancelled_caught and not entered
    drain_check(adm)


@pytest.mark.req("lease-lifecycle", "disconnect-exclusion", "revoked-in-flight")
async def test_fencing_revokes_holder_counters_zero_at_once(autojump_clock, pool, spawn, drain_check):
    """[lease-lifecycle] [disconnect-exclusion] disconnect fences: counters 0 before the holder runs,
    the body is cancelled and the ``async with`` raises LeaseRevoked; released exactly once, at the
    body's exit [revoked-in-flight]: until then the bodies count as revoked, still running."""
    adm = Admission(pool.shared(capacity=2, long_cap=1))
    gen = adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        a = await spawn(nursery, adm, BIG, long=True)
        b = await spawn(nursery, adm, FAST)
        t0 = trio.current_time()
        assert adm.disconnect("node-a", gen)
        snap = adm.snapshot().provider("node-a", "gpu0")
        assert (snap.in_flight, snap.long_in_flight) == (0, 0)
        assert (snap.revoked_in_flight, snap.revoked_long_in_flight) == (2, 1)
        assert not a.lease.released and a.lease.revoked
        await trio.testing.wait_all_tasks_blocked()
        snap = adm.snapshot().provider("node-a", "gpu0")
        assert (snap.revoked_in_flight, snap.revoked_long_in_flight) == (0, 0)
        for r in (a, b):
            assert r.lease.released
            assert isinstance(r.error, LeaseRevoked)
            assert r.error.lease_id == r.lease.id and r.error.generation == gen
            assert r.ended_at == t0 and not r.body_finished
    drain_check(adm)


@pytest.mark.req("lease-lifecycle")
async def test_cancel_in_same_tick_as_grant_holds_then_releases(autojump_clock, pool, handoff, drain_check):
    """[lease-lifecycle] a waiter granted by a release and cancelled in the same tick (before its
    task runs) owns the lease, and releases it when the task runs, without entering the body
    (as under asyncio): no leak."""
    adm = Admission(pool.shared())
    adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        # Released: the grant is handed to the waiter's task; cancel it in the same tick.
        w = await handoff(nursery, adm, FAST)
        w.scope.cancel()
        assert adm.snapshot().provider("node-a", "gpu0").in_flight == 1
        await trio.testing.wait_all_tasks_blocked()
        assert w.cancelled
        assert w.lease is None and not w.body_finished  # the body never started
    drain_check(adm)


@pytest.mark.req("lease-lifecycle")
async def test_cancel_before_release_in_same_tick_withdraws(autojump_clock, pool, spawn, drain_check):
    """[lease-lifecycle] cancelled first, then the capacity frees in the same tick: the waiter
    is withdrawn, holds nothing, and the slot goes to the next waiter."""
    adm = Admission(pool.shared())
    adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        first = await spawn(nursery, adm, FAST)
        second = await spawn(nursery, adm, BIG)
        first.scope.cancel()
        holder.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert first.cancelled and first.lease is None
        assert second.lease is not None
        second.release.set()
    drain_check(adm)


@pytest.mark.req("lease-lifecycle")
@pytest.mark.parametrize("steps", range(8))
@pytest.mark.parametrize("scenario", ["immediate", "granted-by-release", "failed-by-disconnect"])
async def test_cancel_at_every_await_never_leaks(autojump_clock, pool, spawn, drain_check, steps, scenario):
    """[lease-lifecycle] cancel the scope around ``async with`` after 0..7 scheduler steps of
    the acquire path: the request either holds its lease and releases it, or holds nothing."""
    adm = Admission(pool.shared())
    gen = adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        holder = None
        if scenario != "immediate":
            holder = await spawn(nursery, adm, BIG)
        req = await spawn(nursery, adm, FAST, hold=1.0, settle=False)
        if scenario == "granted-by-release":
            holder.release.set()
        elif scenario == "failed-by-disconnect":
            await trio.lowlevel.checkpoint()
            adm.disconnect("node-a", gen)
        for _ in range(steps):
            await trio.lowlevel.checkpoint()
        req.scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert req.done.is_set()
        if req.lease is not None:
            assert req.lease.released
        if holder is not None and scenario == "granted-by-release":
            assert holder.lease.released
    drain_check(adm)


@pytest.mark.req("lease-lifecycle")
async def test_reentering_lease_scope_raises(autojump_clock, pool, drain_check):
    """[lease-lifecycle] a LeaseScope is single use: entering it again raises RuntimeError."""
    adm = Admission(pool.shared(capacity=2, long_cap=1))
    adm.connect("node-a")
    scope = adm.lease(BIG)
    async with scope:
        with pytest.raises(RuntimeError):
            async with scope:
                pass  # pragma: no cover
        assert adm.snapshot().provider("node-a", "gpu0").in_flight == 1
    with pytest.raises(RuntimeError):
        async with scope:
            pass  # pragma: no cover
    drain_check(adm)


@pytest.mark.req("lease-lifecycle")
async def test_reentering_lease_scope_while_parked_raises(autojump_clock, pool, spawn, drain_check):
    """[lease-lifecycle] entering a LeaseScope from a second task while the first entry is
    still parked in the queue raises RuntimeError (else two grants share one scope and one leaks)."""
    adm = Admission(pool.shared())
    adm.connect("node-a")
    scope = adm.lease(FAST)
    errors: list[BaseException] = []

    async def enter() -> None:
        try:
            async with scope:
                await trio.sleep(1)
        except RuntimeError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        nursery.start_soon(enter)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(enter)
        await trio.testing.wait_all_tasks_blocked()
        assert len(errors) == 1
        holder.release.set()
    drain_check(adm)


# ------------------------------------------------------------------- [long-state]


@pytest.mark.req("long-state", "cross-model-tests")
async def test_long_slots_shared_across_groups(autojump_clock, pool, spawn, drain_check):
    """[long-state] [cross-model-tests] long leases of both groups never exceed the long slots."""
    adm = Admission(pool.shared(capacity=3, long_cap=2))
    adm.connect("node-a")
    peak = 0
    running = 0

    async def long_request(model: str) -> None:
        nonlocal peak, running
        async with adm.lease(model, long=True):
            running += 1
            peak = max(peak, running)
            assert adm.snapshot().provider("node-a", "gpu0").long_in_flight <= 2
            await trio.sleep(1)
            running -= 1

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i in range(10):
            nursery.start_soon(long_request, (BIG, FAST)[i % 2])
    assert peak == 2
    assert trio.current_time() - t0 == 5
    drain_check(adm)


@pytest.mark.req("long-state", "cross-group-wakeup")
async def test_long_waiter_does_not_block_normal_behind_it(autojump_clock, pool, spawn, drain_check):
    """[long-state] [cross-group-wakeup] no head-of-line blocking: a long request waiting for
    the long slot is skipped and a later normal request of the other group runs at once."""
    adm = Admission(pool.shared(capacity=2, long_cap=1))
    adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        long_a = await spawn(nursery, adm, BIG, long=True)
        long_b = await spawn(nursery, adm, FAST, long=True)
        assert long_a.lease is not None and long_b.waiting
        normal = await spawn(nursery, adm, BIG)
        assert normal.lease is not None and not normal.lease.long
        snap = adm.snapshot()
        p = snap.provider("node-a", "gpu0")
        assert (snap.queue_depth, p.in_flight, p.long_in_flight, p.queued, p.long_queued) == (1, 2, 1, 1, 1)
        # A normal slot frees: still no long slot, so the long waiter keeps waiting.
        normal.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert long_b.waiting
        long_a.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert long_b.lease is not None and long_b.lease.long
        long_b.release.set()
    drain_check(adm)


@pytest.mark.req("long-state")
def test_config_error_total_context_and_long_cap(pool):
    """[long-state] ProviderSpec rejects total != window * long_cap and long_cap > capacity."""
    with pytest.raises(ConfigError) as info:
        ProviderSpec(capacity=1, long_context_capacity=1, context_window_tokens=32768, total_context_tokens=65536)
    assert len(info.value.problems) == 1
    assert "total_context_tokens" in info.value.problems[0]
    with pytest.raises(ConfigError) as info:
        ProviderSpec(capacity=1, long_context_capacity=2, context_window_tokens=32768, total_context_tokens=65536)
    assert len(info.value.problems) == 1
    assert "long_context_capacity" in info.value.problems[0]
    with pytest.raises(ConfigError) as info:
        ProviderSpec(capacity=1, long_context_capacity=2, context_window_tokens=100, total_context_tokens=1)
    assert len(info.value.problems) == 2  # every problem at once


@pytest.mark.req("long-state")
def test_config_error_lists_every_problem_at_admission(pool):
    """[long-state] Admission(...) with a bad PoolConfig raises ConfigError listing each problem."""
    unknown = ProviderKey("node-x", "gpu9")
    bad = PoolConfig(
        policy=QueuePolicy(),
        providers={pool.gpu0: pool.spec()},
        models={BIG: ModelGroup(candidates=(pool.gpu0, unknown)), FAST: ModelGroup(candidates=(unknown,))},
    )
    with pytest.raises(ConfigError) as info:
        Admission(bad)
    assert len(info.value.problems) == 2
    assert all("node-x/gpu9" in p for p in info.value.problems)
    assert any(BIG in p for p in info.value.problems) and any(FAST in p for p in info.value.problems)
    with pytest.raises(ConfigError) as alone:
        validate_pool(bad)  # the same verdict without an Admission (what a config loader reports)
    assert alone.value.problems == info.value.problems


# ----------------------------------------------------------- [cross-group-wakeup]


@pytest.mark.req("cross-group-wakeup")
async def test_release_in_group_a_wakes_waiter_of_group_b(autojump_clock, pool, spawn, drain_check):
    """[cross-group-wakeup] completion of an ornith:35b lease grants the ornith-fast waiter at once."""
    adm = Admission(pool.shared())
    adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        a = await spawn(nursery, adm, BIG, hold=3.0)
        b = await spawn(nursery, adm, FAST, hold=1.0)
        await b.done.wait()
        assert a.ended_at == 3.0 + a.granted_at
        assert b.granted_at == a.ended_at
        assert b.lease.queue_wait == 3.0
    drain_check(adm)


@pytest.mark.req("cross-group-wakeup")
async def test_global_arrival_order_across_groups(autojump_clock, pool, spawn, drain_check):
    """[cross-group-wakeup] waiters of alternating groups are granted in global arrival order."""
    adm = Admission(pool.shared())
    adm.connect("node-a")
    log: list = []
    async with trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        t0 = trio.current_time()
        waiters = [await spawn(nursery, adm, (FAST, BIG)[i % 2], hold=1.0, log=log) for i in range(6)]
        assert adm.snapshot().queue_depth == 6
        holder.release.set()
    assert log == waiters
    assert [w.granted_at - t0 for w in waiters] == [0, 1, 2, 3, 4, 5]
    drain_check(adm)


@pytest.mark.req("cross-group-wakeup")
async def test_newcomer_never_overtakes_parked_waiter(autojump_clock, pool, handoff, drain_check):
    """[cross-group-wakeup] hand-off: a request arriving in the tick a lease is released queues
    behind the parked waiter, who already owns the slot."""
    adm = Admission(pool.shared())
    adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        waiter = await handoff(nursery, adm, FAST, hold=1.0)
        t0 = trio.current_time()
        async with adm.lease(BIG) as mine:  # the newcomer, same tick as the release
            assert waiter.lease is not None and waiter.granted_at == t0
            assert trio.current_time() == t0 + 1
            assert mine.queue_wait == 1
    drain_check(adm)


@pytest.mark.req("cross-group-wakeup")
async def test_priority_then_load_then_candidate_order(autojump_clock, pool, drain_check):
    """[cross-group-wakeup] highest priority wins; ties go to lowest in_flight/capacity,
    then to candidate order."""
    adm = Admission(pool.two_nodes(gpu0=pool.spec(1, 1), gpu1=pool.spec(1, 1, priority=5)))
    adm.connect("node-a")
    adm.connect("node-b")
    async with adm.lease(BIG) as first:
        assert first.provider == pool.gpu1
        async with adm.lease(BIG) as second:
            assert second.provider == pool.gpu0

    adm2 = Admission(pool.two_nodes(gpu0=pool.spec(2, 1), gpu1=pool.spec(4, 1)))
    adm2.connect("node-a")
    adm2.connect("node-b")
    async with (
        adm2.lease(BIG) as l1,  # 0/2 vs 0/4: tie -> candidate order
        adm2.lease(BIG) as l2,  # 1/2 vs 0/4
        adm2.lease(BIG) as l3,  # 1/2 vs 1/4
        adm2.lease(BIG) as l4,  # 1/2 vs 2/4: tie -> candidate order
    ):
        assert [x.provider for x in (l1, l2, l3, l4)] == [pool.gpu0, pool.gpu1, pool.gpu1, pool.gpu0]
    drain_check(adm)
    drain_check(adm2)


@pytest.mark.req("cross-group-wakeup")
async def test_queued_waiter_granted_to_higher_priority(autojump_clock, pool, spawn, drain_check):
    """[cross-group-wakeup] a waiter woken when both candidates free at once takes the higher priority."""
    adm = Admission(pool.two_nodes(gpu0=pool.spec(1, 1), gpu1=pool.spec(1, 1, priority=1)))
    adm.connect("node-a")
    adm.connect("node-b")
    async with trio.open_nursery() as nursery:
        on_gpu1 = await spawn(nursery, adm, BIG)
        on_gpu0 = await spawn(nursery, adm, BIG)
        assert (on_gpu1.lease.provider, on_gpu0.lease.provider) == (pool.gpu1, pool.gpu0)
        waiter = await spawn(nursery, adm, BIG)
        # Raising gpu0's priority and both capacities frees room on both at once.
        adm.refresh(pool.two_nodes(gpu0=pool.spec(2, 1, priority=9), gpu1=pool.spec(2, 1, priority=1)))
        await trio.testing.wait_all_tasks_blocked()
        assert waiter.lease.provider == pool.gpu0
        for r in (on_gpu0, on_gpu1, waiter):
            r.release.set()
    drain_check(adm)


# ---------------------------------------------------------------- [queue-ownership]


@pytest.mark.req("queue-ownership")
@pytest.mark.parametrize("layout", ["one-group-many-providers", "many-groups-one-provider"])
async def test_queue_full_and_timeout_edge_wide(autojump_clock, pool, spawn, drain_check, layout):
    """[queue-ownership] max_queue and queue_timeout hold for a group with many providers and
    for many groups sharing one provider: QueueFull at once, QueueTimeout at exactly enqueue+timeout."""
    keys = [ProviderKey(f"node-{i}", "gpu0") for i in range(3)]
    policy = QueuePolicy(max_queue=2, queue_timeout=4.0)
    if layout == "one-group-many-providers":
        config = PoolConfig(policy, {k: pool.spec() for k in keys}, {BIG: ModelGroup(candidates=keys)})
        models = [BIG] * 3
    else:
        keys = keys[:1]
        models = ["m0", "m1", "m2"]
        config = PoolConfig(policy, {keys[0]: pool.spec()}, {m: ModelGroup(candidates=keys) for m in models})
    adm = Admission(config)
    for k in keys:
        adm.connect(k.node_id)
    async with trio.open_nursery() as nursery:
        holders = [await spawn(nursery, adm, models[i % len(models)]) for i in range(len(keys))]
        assert all(h.lease is not None for h in holders)
        t0 = trio.current_time()
        w1 = await spawn(nursery, adm, models[0])
        await trio.sleep(1)
        w2 = await spawn(nursery, adm, models[-1])
        assert adm.snapshot().queue_depth == 2
        with pytest.raises(QueueFull) as info:
            async with adm.lease(models[1]):
                pass  # pragma: no cover
        assert info.value.max_queue == 2
        assert trio.current_time() == t0 + 1
        await w2.done.wait()
        for w, start in ((w1, t0), (w2, t0 + 1)):
            assert isinstance(w.error, QueueTimeout)
            assert w.ended_at == start + 4.0 and w.error.waited == 4.0
        for h in holders:
            h.release.set()
    drain_check(adm)


@pytest.mark.req("queue-ownership")
async def test_max_queue_zero_never_queues(autojump_clock, pool, spawn, drain_check):
    """[queue-ownership] max_queue=0: a request that cannot run now gets QueueFull at once."""
    adm = Admission(pool.shared(max_queue=0))
    adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        t0 = trio.current_time()
        with pytest.raises(QueueFull):
            async with adm.lease(FAST):
                pass  # pragma: no cover
        assert trio.current_time() == t0 and adm.snapshot().queue_depth == 0
        holder.release.set()
    async with adm.lease(FAST):  # room: granted without queueing
        pass
    drain_check(adm)


@pytest.mark.req("queue-ownership")
async def test_queue_timeout_exact_and_slot_still_usable(autojump_clock, pool, spawn, drain_check):
    """[queue-ownership] a timed-out waiter leaves nothing behind; QueueTimeout carries waited."""
    adm = Admission(pool.shared(queue_timeout=2.5))
    adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        t0 = trio.current_time()
        with pytest.raises(QueueTimeout) as info:
            async with adm.lease(FAST):
                pass  # pragma: no cover
        assert trio.current_time() - t0 == 2.5 and info.value.waited == 2.5
        assert adm.snapshot().queue_depth == 0
        holder.release.set()
    drain_check(adm)


@pytest.mark.req("queue-ownership")
async def test_a_deadline_expires_through_the_core_a_cancel_withdraws(autojump_clock, pool, spawn, drain_check):
    """[queue-ownership] a queue timeout in production is the core's expire() (TIMED_OUT), the
    path the state machine proves; a cancellation before the deadline is a withdraw."""
    adm = Admission(pool.shared(queue_timeout=2.0))
    adm.connect("node-a")
    waiters: list[Waiter] = []
    request = adm._core.request

    def recording(
        model: str, long: bool, now: float, tenant: str | None = None, cost: float = 1.0, tokens: int | None = None
    ) -> Lease | Waiter:
        result = request(model, long, now, tenant, cost, tokens)
        if isinstance(result, Waiter):
            waiters.append(result)
        return result

    adm._core.request = recording  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        with pytest.raises(QueueTimeout):
            async with adm.lease(FAST):
                pass  # pragma: no cover
        with trio.move_on_after(1.0):
            async with adm.lease(FAST):
                pass  # pragma: no cover
        holder.release.set()
    assert [w.state for w in waiters] == [WaiterState.TIMED_OUT, WaiterState.WITHDRAWN]
    drain_check(adm)


@pytest.mark.req("lease-lifecycle")
async def test_state_changes_run_protected_from_keyboard_interrupt(autojump_clock, pool, spawn, drain_check):
    """[lease-lifecycle] Ctrl-C cannot land half-way through a grant, a release, a (dis)connect or
    a refresh: every call into the core runs KI-protected, as trio's own Lock does."""
    adm = Admission(pool.shared(capacity=1, long_cap=1))
    core = adm._core
    calls: list[tuple[str, bool]] = []

    def recording(name, method):
        def call(*args):
            calls.append((name, trio.lowlevel.currently_ki_protected()))
            return method(*args)

        return call

    for name in ("request", "release", "withdraw", "expire", "connect", "disconnect", "refresh"):
        setattr(core, name, recording(name, getattr(core, name)))
    gen = adm.connect("node-a")
    async with adm.lease(BIG), trio.open_nursery() as nursery:
        await spawn(nursery, adm, FAST)  # queued behind BIG
        nursery.cancel_scope.cancel()  # withdrawn
    adm.refresh(pool.shared(capacity=2, long_cap=1))
    adm.disconnect("node-a", gen)
    assert {name for name, _ in calls} == {
        "request",
        "release",
        "withdraw",
        "expire",
        "connect",
        "disconnect",
        "refresh",
    }
    assert all(protected for _, protected in calls), calls
    drain_check(adm)


@pytest.mark.req("long-state")
def test_validate_pool_reports_a_shared_bad_spec_for_every_provider(pool):
    """[long-state] A spec shared by many providers is checked once when sound; a shared spec
    changed past its own checks (as ``evolve()`` tricks could) is reported for each provider."""
    sound = pool.spec()
    keys = [ProviderKey(f"node-{i}", "gpu0") for i in range(3)]
    validate_pool(PoolConfig(providers=dict.fromkeys(keys, sound), models={BIG: ModelGroup(candidates=tuple(keys))}))
    bad = pool.spec()
    object.__setattr__(bad, "capacity", 0)
    with pytest.raises(ConfigError) as info:
        validate_pool(
            PoolConfig(
                providers={keys[0]: sound, keys[1]: bad, keys[2]: bad}, models={BIG: ModelGroup(candidates=tuple(keys))}
            )
        )
    where = {p.split("]")[0] + "]" for p in info.value.problems}
    assert where == {f"providers[{keys[1]}]", f"providers[{keys[2]}]"}
    assert sum(f"providers[{keys[1]}].capacity" in p for p in info.value.problems) == 1


# ------------------------------------------------ a queued lease's body scope


@pytest.mark.req("lease-lifecycle")
async def test_queued_lease_body_outlives_queue_deadline_and_is_still_revoked(autojump_clock, pool, drain_check):
    """[lease-lifecycle] A lease granted from the queue keeps the scope that carried its queue
    deadline as its body's scope: the deadline no longer applies to the body, a refresh does not
    re-arm it, and fencing still cancels the body with LeaseRevoked."""
    config = pool.shared(queue_timeout=5.0)
    adm = Admission(config)
    generation = adm.connect("node-a")
    release_first = trio.Event()
    outcome: dict[str, object] = {}

    async def first() -> None:
        async with adm.lease(BIG):
            await release_first.wait()

    async def second() -> None:
        try:
            async with adm.lease(FAST):
                outcome["granted_at"] = trio.current_time()
                await trio.sleep(20.0)  # well past the 5 s queue deadline
                adm.refresh(config)  # re-arms parked waiters only, never a body
                await trio.sleep(20.0)
                outcome["body_done"] = trio.current_time()
                await trio.sleep_forever()
        except LeaseRevoked:
            outcome["revoked_at"] = trio.current_time()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        assert adm.queue_depth == 1
        await trio.sleep(1.0)
        release_first.set()  # granted from the queue before its deadline
        await trio.sleep(41.0)
        assert outcome["body_done"] == outcome["granted_at"] + 40.0
        fenced_at = trio.current_time()
        adm.disconnect("node-a", generation)
    assert outcome["revoked_at"] == fenced_at
    drain_check(adm)

"""Live config refresh: validated as a whole, applied atomically, leases kept.

[refresh-consistency] [cross-group-wakeup] [cross-model-tests]
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iop_admission import (
    Admission,
    ConfigError,
    ModelGroup,
    ModelNotFound,
    PoolConfig,
    ProviderKey,
    QueuePolicy,
    QueueTimeout,
    Unavailable,
)

BIG = "ornith:35b"
FAST = "ornith-fast"


@pytest.mark.req("refresh-consistency")
async def test_lower_capacity_below_in_flight_keeps_leases(autojump_clock, pool, spawn, drain_check):
    """[refresh-consistency] capacity 3 -> 1 with 3 running: leases keep running; new admission
    waits until in_flight < 1, i.e. until all three ended."""
    adm = Admission(pool.shared(capacity=3, long_cap=1))
    adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        running = [await spawn(nursery, adm, (BIG, FAST)[i % 2]) for i in range(3)]
        adm.refresh(pool.shared(capacity=1, long_cap=1))
        p = adm.snapshot().provider("node-a", "gpu0")
        assert (p.capacity, p.in_flight) == (1, 3)
        waiter = await spawn(nursery, adm, FAST)
        for r in running[:2]:
            r.release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert waiter.waiting
        assert all(not r.lease.revoked and r.error is None for r in running)
        running[2].release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert waiter.lease is not None
        assert adm.snapshot().provider("node-a", "gpu0").in_flight == 1
        waiter.release.set()
    drain_check(adm)


@pytest.mark.req("refresh-consistency")
async def test_raise_capacity_grants_waiters_at_once(autojump_clock, pool, spawn, drain_check):
    """[refresh-consistency] capacity 1 -> 3: both groups' waiters are granted in the refresh."""
    adm = Admission(pool.shared())
    adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        waiters = [await spawn(nursery, adm, m) for m in (FAST, BIG, FAST)]
        t0 = trio.current_time()
        adm.refresh(pool.shared(capacity=3, long_cap=1))
        assert adm.snapshot().queue_depth == 1  # granted synchronously, in arrival order
        await trio.testing.wait_all_tasks_blocked()
        assert [w.granted_at for w in waiters[:2]] == [t0, t0] and waiters[2].waiting
        for r in (holder, *waiters):
            r.release.set()
    drain_check(adm)


@pytest.mark.req("refresh-consistency")
async def test_disable_fails_or_falls_back_then_enable_grants(autojump_clock, pool, spawn, drain_check):
    """[refresh-consistency] disabling gpu0: ornith-fast's waiter (gpu0 only) fails Unavailable
    at once, ornith:35b's waiter falls back to gpu1; the running lease continues. Re-enabling
    grants a queued waiter at once."""
    adm = Admission(pool.two_nodes())
    adm.connect("node-a")
    adm.connect("node-b")
    async with trio.open_nursery() as nursery:
        on_a = await spawn(nursery, adm, FAST)
        on_b = await spawn(nursery, adm, BIG)
        fast_w = await spawn(nursery, adm, FAST)
        big_w = await spawn(nursery, adm, BIG)
        t0 = trio.current_time()
        adm.refresh(pool.two_nodes(gpu0=pool.spec(enabled=False)))
        await trio.testing.wait_all_tasks_blocked()
        assert isinstance(fast_w.error, Unavailable) and fast_w.ended_at == t0
        assert big_w.waiting and adm.snapshot().queue_depth == 1
        assert adm.snapshot().provider("node-a", "gpu0").status == "disabled"
        assert on_a.lease is not None and not on_a.lease.released  # running lease kept
        on_a.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert big_w.waiting  # gpu0 freed but disabled
        adm.refresh(pool.two_nodes())
        await trio.testing.wait_all_tasks_blocked()
        assert big_w.lease.provider == pool.gpu0 and big_w.granted_at == t0
        for r in (on_b, big_w):
            r.release.set()
    drain_check(adm)


@pytest.mark.req("refresh-consistency", "queue-ownership")
@pytest.mark.parametrize(
    ("new_timeout", "expected_end"),
    [(1.0, 3.0), (6.0, 6.0), (16.0, 16.0)],
    ids=["shorter-already-past", "shorter-in-future", "longer"],
)
async def test_new_queue_timeout_applies_to_queued_waiters(
    autojump_clock, pool, spawn, drain_check, new_timeout, expected_end
):
    """[refresh-consistency] [queue-ownership] a new queue_timeout moves every queued waiter's
    deadline to enqueue + new timeout; one already past times out at once."""
    adm = Admission(pool.shared(queue_timeout=8.0))
    adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        t0 = trio.current_time()
        waiter = await spawn(nursery, adm, FAST)
        await trio.sleep(3)
        adm.refresh(pool.shared(queue_timeout=new_timeout))
        assert adm.snapshot().queue_timeout == new_timeout
        await waiter.done.wait()
        assert isinstance(waiter.error, QueueTimeout)
        assert waiter.ended_at - t0 == expected_end
        holder.release.set()
    drain_check(adm)


@pytest.mark.req("refresh-consistency")
async def test_model_group_removed_fails_its_waiters(autojump_clock, pool, spawn, drain_check):
    """[refresh-consistency] removing ornith-fast fails its waiter with ModelNotFound at once;
    the ornith:35b waiter stays queued; new requests for the removed model fail."""
    adm = Admission(pool.shared())
    adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        fast_w = await spawn(nursery, adm, FAST)
        big_w = await spawn(nursery, adm, BIG)
        t0 = trio.current_time()
        adm.refresh(pool.shared(models=(BIG,)))
        await trio.testing.wait_all_tasks_blocked()
        assert isinstance(fast_w.error, ModelNotFound) and fast_w.ended_at == t0
        assert big_w.waiting and adm.snapshot().queue_depth == 1
        with pytest.raises(ModelNotFound):
            async with adm.lease(FAST):
                pass  # pragma: no cover
        holder.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert big_w.lease is not None
        big_w.release.set()
    drain_check(adm)


@pytest.mark.req("refresh-consistency")
async def test_invalid_refresh_changes_nothing(autojump_clock, pool, spawn, drain_check):
    """[refresh-consistency] an invalid refresh raises ConfigError listing every problem and
    leaves config, snapshot, leases and waiters as they were."""
    adm = Admission(pool.shared())
    adm.connect("node-a")
    unknown = ProviderKey("node-z", "gpu7")
    bad = PoolConfig(
        policy=QueuePolicy(max_queue=1, queue_timeout=1.0),
        providers={pool.gpu0: pool.spec(capacity=4, long_cap=1)},
        models={BIG: ModelGroup(candidates=(unknown,)), FAST: ModelGroup(candidates=(pool.gpu0, pool.gpu0))},
    )
    async with trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        waiter = await spawn(nursery, adm, FAST)
        before, config = adm.snapshot(), adm.config
        with pytest.raises(ConfigError) as info:
            adm.refresh(bad)
        assert len(info.value.problems) == 2
        await trio.testing.wait_all_tasks_blocked()
        assert adm.snapshot() == before and adm.config is config
        assert waiter.waiting  # capacity 4 was not applied
        holder.release.set()
        await trio.testing.wait_all_tasks_blocked()
        waiter.release.set()
    assert waiter.lease is not None
    drain_check(adm)


@pytest.mark.req("refresh-consistency", "removed-provider-visible")
async def test_provider_removed_while_leased(autojump_clock, pool, spawn, drain_check):
    """[refresh-consistency] a provider dropped from config keeps its running lease (released
    once, at the holder's exit) and takes no new work; [removed-provider-visible] it stays in
    the snapshot, marked removed, until that lease ends."""
    adm = Admission(pool.two_nodes())
    adm.connect("node-a")
    adm.connect("node-b")
    async with trio.open_nursery() as nursery:
        on_a = await spawn(nursery, adm, FAST)
        adm.refresh(pool.single())
        snap = adm.snapshot()
        assert [(p.node_id, p.provider_id, p.status) for p in snap.providers] == [
            ("node-b", "gpu1", "available"),
            ("node-a", "gpu0", "removed"),
        ]
        assert snap.provider("node-a", "gpu0").in_flight == 1
        assert not on_a.lease.released
        async with adm.lease(BIG) as lease:
            assert lease.provider == pool.gpu1
        on_a.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert on_a.lease.released and not on_a.lease.revoked and on_a.error is None
        assert [p.provider_id for p in adm.snapshot().providers] == ["gpu1"]
        # Bringing it back later starts from a clean state.
        adm.refresh(pool.two_nodes())
        assert adm.snapshot().provider("node-a", "gpu0").in_flight == 0
    drain_check(adm)


@pytest.mark.req("refresh-consistency", "disconnect-exclusion")
async def test_provider_removed_while_leased_then_fenced(autojump_clock, pool, spawn, drain_check):
    """[refresh-consistency] [disconnect-exclusion] a retired provider's lease is still fenced
    by its node's disconnect, and released exactly once."""
    adm = Admission(pool.two_nodes())
    gen_a = adm.connect("node-a")
    adm.connect("node-b")
    async with trio.open_nursery() as nursery:
        on_a = await spawn(nursery, adm, FAST)
        adm.refresh(pool.single())
        assert adm.disconnect("node-a", gen_a)
        await trio.testing.wait_all_tasks_blocked()
        assert on_a.lease.revoked and on_a.error is not None
    drain_check(adm)

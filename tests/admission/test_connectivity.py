"""Node connectivity drives availability: generations, fencing, queue resolution,
offline snapshot.

[disconnect-exclusion] [disconnect-queue-resolution] [offline-snapshot]
[cross-model-tests]
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iop_admission import Admission, LeaseRevoked, Unavailable

BIG = "ornith:35b"
FAST = "ornith-fast"


@pytest.mark.req("disconnect-exclusion")
def test_connect_returns_increasing_generations(pool, drain_check):
    """[disconnect-exclusion] every accepted registration is a new, larger generation
    (works without a trio loop)."""
    adm = Admission(pool.shared())
    assert adm.generation("node-a") == 0 and not adm.is_connected("node-a")
    g1 = adm.connect("node-a")
    g2 = adm.connect("node-a")  # connect while connected: new generation
    assert adm.disconnect("node-a", g2)
    g3 = adm.connect("node-a")
    assert 0 < g1 < g2 < g3
    assert adm.generation("node-a") == g3 and adm.is_connected("node-a")
    drain_check(adm)


@pytest.mark.req("disconnect-exclusion")
async def test_stale_disconnect_changes_nothing(autojump_clock, pool, spawn, drain_check):
    """[disconnect-exclusion] closing a stale connection returns False and changes nothing:
    the current generation's lease and waiter are untouched."""
    adm = Admission(pool.shared())
    old = adm.connect("node-a")
    new = adm.connect("node-a")
    assert not adm.disconnect("node-x", 1)  # never connected
    async with trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        waiter = await spawn(nursery, adm, FAST)
        before = adm.snapshot()
        assert not adm.disconnect("node-a", old)
        assert not adm.disconnect("node-a", new + 1)
        await trio.testing.wait_all_tasks_blocked()
        assert adm.snapshot() == before
        assert not holder.lease.revoked and holder.lease.generation == new and waiter.waiting
        holder.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert waiter.lease.generation == new
        waiter.release.set()
    assert adm.disconnect("node-a", new)
    assert not adm.disconnect("node-a", new)  # already offline: no effect
    drain_check(adm)


@pytest.mark.req("disconnect-queue-resolution")
async def test_disconnect_fallback_to_remaining_candidate(autojump_clock, pool, spawn, drain_check):
    """[disconnect-queue-resolution] a waiter with another eligible candidate stays queued and
    is granted there; the fenced holder gets LeaseRevoked."""
    adm = Admission(pool.two_nodes())
    gen_a = adm.connect("node-a")
    adm.connect("node-b")
    async with trio.open_nursery() as nursery:
        on_a = await spawn(nursery, adm, FAST)  # ornith-fast: gpu0 only
        on_b = await spawn(nursery, adm, BIG)  # ornith:35b: gpu0 busy -> gpu1
        assert (on_a.lease.provider, on_b.lease.provider) == (pool.gpu0, pool.gpu1)
        waiter = await spawn(nursery, adm, BIG)
        t0 = trio.current_time()
        assert adm.disconnect("node-a", gen_a)
        await trio.testing.wait_all_tasks_blocked()
        assert isinstance(on_a.error, LeaseRevoked) and on_a.ended_at == t0
        assert waiter.waiting
        snap = adm.snapshot()
        assert snap.queue_depth == 1
        assert snap.provider("node-b", "gpu1").queued == 1
        assert snap.provider("node-a", "gpu0").queued == 0  # offline: no pressure
        on_b.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert waiter.lease.provider == pool.gpu1
        waiter.release.set()
    drain_check(adm)


@pytest.mark.req("disconnect-queue-resolution", "cross-model-tests")
async def test_disconnect_fails_stranded_waiters_at_once(autojump_clock, pool, spawn, drain_check):
    """[disconnect-queue-resolution] [cross-model-tests] waiters of both groups with no eligible
    candidate left end with Unavailable at once, without waiting out the queue timeout."""
    adm = Admission(pool.shared())
    gen = adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        waiters = [await spawn(nursery, adm, m, long=(m == BIG)) for m in (FAST, BIG)]
        t0 = trio.current_time()
        assert adm.disconnect("node-a", gen)
        assert adm.snapshot().queue_depth == 0  # resolved synchronously
        await trio.testing.wait_all_tasks_blocked()
        assert isinstance(holder.error, LeaseRevoked)
        for w, model in zip(waiters, (FAST, BIG), strict=True):
            assert isinstance(w.error, Unavailable) and w.error.model == model
            assert w.ended_at == t0 and w.lease is None
    drain_check(adm)


@pytest.mark.req("disconnect-queue-resolution")
async def test_no_eligible_candidate_unavailable_never_queued(autojump_clock, pool, drain_check):
    """[disconnect-queue-resolution] a request for a model with no eligible candidate is
    answered Unavailable at once and never queued (never connected, and after a disconnect)."""
    adm = Admission(pool.shared())
    t0 = trio.current_time()
    for model in (BIG, FAST):
        with pytest.raises(Unavailable):
            async with adm.lease(model):
                pass  # pragma: no cover
    gen = adm.connect("node-a")
    adm.disconnect("node-a", gen)
    with pytest.raises(Unavailable) as info:
        async with adm.lease(BIG, long=True):
            pass  # pragma: no cover
    assert info.value.long
    assert trio.current_time() == t0
    drain_check(adm)


@pytest.mark.req("disconnect-queue-resolution", "long-state")
async def test_long_request_unavailable_without_long_slots(autojump_clock, pool, spawn, drain_check):
    """[disconnect-queue-resolution] [long-state] a long request on providers with no long
    slot is Unavailable at once, even while a normal request must queue."""
    adm = Admission(pool.shared(capacity=1, long_cap=0))
    adm.connect("node-a")
    with pytest.raises(Unavailable):
        async with adm.lease(BIG, long=True):
            pass  # pragma: no cover
    async with trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        with pytest.raises(Unavailable):
            async with adm.lease(FAST, long=True):
                pass  # pragma: no cover
        assert adm.snapshot().queue_depth == 0
        holder.release.set()
    drain_check(adm)


@pytest.mark.req("disconnect-exclusion", "revoked-in-flight")
async def test_connect_while_connected_fences_old_generation(autojump_clock, pool, spawn, drain_check):
    """[disconnect-exclusion] a duplicate registration starts a new generation and fences the
    old one: its holder gets LeaseRevoked; the waiter is granted on the new generation in the
    same tick, once the revoked body has left [revoked-in-flight]."""
    adm = Admission(pool.shared())
    old = adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        waiter = await spawn(nursery, adm, FAST)
        t0 = trio.current_time()
        new = adm.connect("node-a")
        assert new > old
        p = adm.snapshot().provider("node-a", "gpu0")
        assert (p.in_flight, p.generation, p.connected) == (0, new, True)
        assert p.revoked_in_flight == 1  # the old body holds the capacity until it leaves
        await trio.testing.wait_all_tasks_blocked()
        p = adm.snapshot().provider("node-a", "gpu0")
        assert (p.in_flight, p.revoked_in_flight) == (1, 0)  # the waiter's grant
        assert isinstance(holder.error, LeaseRevoked) and holder.error.generation == old
        assert waiter.lease.generation == new and waiter.granted_at == t0
        assert not adm.disconnect("node-a", old)
        waiter.release.set()
    drain_check(adm)


@pytest.mark.req("offline-snapshot", "disconnect-exclusion")
async def test_reconnect_brings_provider_back(autojump_clock, pool, drain_check):
    """[offline-snapshot] [disconnect-exclusion] reconnect: same provider identity, new
    generation, status available; leases carry the new generation."""
    adm = Admission(pool.shared())
    g1 = adm.connect("node-a")
    adm.disconnect("node-a", g1)
    g2 = adm.connect("node-a")
    p = adm.snapshot().provider("node-a", "gpu0")
    assert (p.connected, p.status, p.health, p.generation, p.effective_capacity) == (
        True,
        "available",
        "online",
        g2,
        1,
    )
    async with adm.lease(FAST) as lease:
        assert lease.generation == g2 and lease.provider == pool.gpu0
    drain_check(adm)


@pytest.mark.req("cross-group-wakeup")
async def test_reconnect_grants_fallback_waiter(autojump_clock, pool, spawn, drain_check):
    """[cross-group-wakeup] a waiter queued on gpu1 that also lists the offline gpu0 is granted
    on gpu0 the moment node-a reconnects."""
    adm = Admission(pool.two_nodes())
    gen_a = adm.connect("node-a")
    adm.connect("node-b")
    adm.disconnect("node-a", gen_a)
    async with trio.open_nursery() as nursery:
        on_b = await spawn(nursery, adm, BIG)
        waiter = await spawn(nursery, adm, BIG)
        assert on_b.lease.provider == pool.gpu1 and waiter.waiting
        gen = adm.connect("node-a")
        await trio.testing.wait_all_tasks_blocked()
        assert waiter.lease.provider == pool.gpu0 and waiter.lease.generation == gen
        for r in (on_b, waiter):
            r.release.set()
    drain_check(adm)


@pytest.mark.req("disconnect-exclusion", "lease-lifecycle")
async def test_fenced_before_task_runs_body_is_cancelled(autojump_clock, pool, handoff, drain_check):
    """[disconnect-exclusion] [lease-lifecycle] a waiter granted by a release and fenced by a
    disconnect in the same tick (before its task runs) must not run its body on the offline
    generation: the ``async with`` raises LeaseRevoked on entry (the body never starts) with no
    virtual time passing."""
    adm = Admission(pool.shared())
    gen = adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        waiter = await handoff(nursery, adm, FAST, hold=10.0)
        t0 = trio.current_time()
        assert adm.disconnect("node-a", gen)  # same tick as the grant
        assert adm.snapshot().provider("node-a", "gpu0").in_flight == 0
        await waiter.done.wait()
        assert waiter.lease is None  # never handed to the body
        assert isinstance(waiter.error, LeaseRevoked)
        assert not waiter.body_finished
        assert waiter.ended_at == t0
    drain_check(adm)


@pytest.mark.req("offline-snapshot")
async def test_offline_snapshot(autojump_clock, pool, drain_check):
    """[offline-snapshot] configured but disconnected: connected False, unavailable, offline,
    effective capacities and counters 0."""
    adm = Admission(pool.shared(capacity=2, long_cap=1))
    p = adm.snapshot().provider("node-a", "gpu0")
    expected = {
        "connected": False,
        "status": "unavailable",
        "health": "offline",
        "generation": 0,
        "capacity": 2,
        "long_context_capacity": 1,
        "effective_capacity": 0,
        "effective_long_capacity": 0,
        "in_flight": 0,
        "long_in_flight": 0,
        "queued": 0,
        "long_queued": 0,
    }
    assert {k: getattr(p, k) for k in expected} == expected
    gen = adm.connect("node-a")
    with pytest.raises(LeaseRevoked):
        async with adm.lease(BIG, long=True):
            adm.disconnect("node-a", gen)
            p = adm.snapshot().provider("node-a", "gpu0")
            assert {k: getattr(p, k) for k in expected} == {**expected, "generation": gen}
    drain_check(adm)


@pytest.mark.req("offline-snapshot")
@pytest.mark.parametrize("connected", [False, True])
def test_disabled_status_whether_connected_or_not(pool, drain_check, connected):
    """[offline-snapshot] a disabled provider reports status "disabled" connected or not;
    health follows the connection; effective capacities are 0."""
    adm = Admission(pool.shared(enabled=False))
    if connected:
        adm.connect("node-a")
    p = adm.snapshot().provider("node-a", "gpu0")
    assert p.status == "disabled" and p.connected is connected
    assert p.health == ("online" if connected else "offline")
    assert (p.effective_capacity, p.effective_long_capacity) == (0, 0)
    drain_check(adm)


@pytest.mark.req("held-elsewhere")
async def test_runs_held_elsewhere_count_until_they_end(autojump_clock, pool, spawn, drain_check):
    """[held-elsewhere] runs another Edge left on a capacity-1 provider hold it: a request waits
    until the count goes down (then it is granted at once), and a new generation drops the count."""
    adm = Admission(pool.shared())
    gen = adm.connect("node-a")
    adm.hold(pool.gpu0, 1)
    assert adm.snapshot().provider("node-a", "gpu0").in_flight == 1
    async with trio.open_nursery() as nursery:
        waiter = await spawn(nursery, adm, BIG)
        assert waiter.waiting and adm.queue_depth == 1
        adm.hold(pool.gpu0, 1)  # the same report again changes nothing
        await trio.testing.wait_all_tasks_blocked()
        assert waiter.waiting
        adm.hold(pool.gpu0, 0)  # the run ended
        await trio.testing.wait_all_tasks_blocked()
        assert waiter.lease is not None and waiter.lease.provider == pool.gpu0
        assert adm.snapshot().provider("node-a", "gpu0").in_flight == 1
        waiter.release.set()
    adm.hold(pool.gpu0, 1)
    assert adm.disconnect("node-a", gen)  # the count belongs to the connection
    assert adm.snapshot().provider("node-a", "gpu0").in_flight == 0
    adm.hold(pool.gpu0, 1)  # offline: ignored
    adm.connect("node-a")
    assert adm.snapshot().provider("node-a", "gpu0").in_flight == 0
    with pytest.raises(ValueError):
        adm.hold(pool.gpu0, -1)
    drain_check(adm)


@pytest.mark.req("held-elsewhere")
async def test_long_runs_held_elsewhere_hold_the_long_slots(autojump_clock, pool, spawn, drain_check):
    """[held-elsewhere] a long run another Edge left on a provider holds one of its long slots: a
    long request waits for it while a short one still runs; lowering the long count alone (the long
    run ended, a short one started: the same number of runs) hands the slot over, a refresh that
    removes the provider forgets both counts, and the counts must make sense."""
    adm = Admission(pool.shared(capacity=4, long_cap=1))
    adm.connect("node-a")
    adm.hold(pool.gpu0, 1, 1)
    gpu0 = adm.snapshot().provider("node-a", "gpu0")
    assert (gpu0.in_flight, gpu0.long_in_flight) == (1, 1)
    async with trio.open_nursery() as nursery:
        long = await spawn(nursery, adm, BIG, long=True)
        short = await spawn(nursery, adm, BIG)
        assert long.waiting and short.lease is not None
        adm.hold(pool.gpu0, 2, 1)  # one more short run elsewhere: the long slot is still taken
        await trio.testing.wait_all_tasks_blocked()
        assert long.waiting
        adm.hold(pool.gpu0, 2, 0)  # the long run ended as another short one started
        await trio.testing.wait_all_tasks_blocked()
        assert long.lease is not None and long.lease.long
        gpu0 = adm.snapshot().provider("node-a", "gpu0")
        assert (gpu0.in_flight, gpu0.long_in_flight) == (4, 1)
        long.release.set()
        short.release.set()
    for runs, long_runs in ((1, 2), (1, -1), (-1, 0)):
        with pytest.raises(ValueError, match="long runs between 0 and them"):
            adm.hold(pool.gpu0, runs, long_runs)
    adm.hold(pool.gpu0, 1, 1)
    adm.refresh(pool.single())  # gpu0 leaves the config: its counts go with it
    adm.refresh(pool.shared(capacity=4, long_cap=1))
    gpu0 = adm.snapshot().provider("node-a", "gpu0")
    assert (gpu0.in_flight, gpu0.long_in_flight) == (0, 0)
    drain_check(adm)

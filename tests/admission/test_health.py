"""Passive provider health and retries in the trio layer, on MockClock with exact times.

[outlier-ejection] consecutive failures eject for a doubling time, one probe,
panic mode; [failover-before-first-byte] a retry keeps its arrival place, never
tries a provider twice, is bounded in attempts and by the queue deadline.
"""

from __future__ import annotations

import attrs
import pytest
import trio
import trio.testing

from iop_admission import (
    Admission,
    AdmissionEvent,
    Lease,
    LeaseRevoked,
    OutlierPolicy,
    PoolConfig,
    QueueTimeout,
    RetriesExhausted,
    RetryPolicy,
    Unavailable,
)

BIG = "ornith:35b"
FAST = "ornith-fast"

pytestmark = pytest.mark.req("outlier-ejection", "failover-before-first-byte")


def _outlier(config: PoolConfig, failures: int = 3, base: float = 5.0, cap: float = 300.0, **kw: object) -> PoolConfig:
    return attrs.evolve(config, outlier=OutlierPolicy(failures, base, cap), **kw)


async def _fail(adm: Admission, model: str, times: int) -> list[Lease]:
    """Run ``times`` leases of ``model`` one after another, each reporting a failure."""
    leases = []
    for _ in range(times):
        async with adm.lease(model) as lease:
            adm.report_failure(lease)
        leases.append(lease)
    return leases


def _health(adm: Admission, node: str, provider: str) -> tuple[str, int, float]:
    p = adm.snapshot().provider(node, provider)
    return p.health, p.failures, p.ejection_left


async def test_consecutive_failures_eject_for_base_time(autojump_clock, pool, drain_check):
    """[outlier-ejection] the 3rd failure in a row ejects gpu0 for exactly 5 s; a success before resets the count."""
    adm = Admission(_outlier(pool.two_nodes(gpu1=pool.spec(priority=-1))))
    adm.connect("node-a")
    adm.connect("node-b")
    await _fail(adm, BIG, 2)
    async with adm.lease(BIG) as ok:
        adm.report_success(ok)
    assert _health(adm, "node-a", "gpu0") == ("online", 0, 0.0)
    leases = await _fail(adm, BIG, 3)
    assert [lease.provider for lease in leases] == [pool.gpu0] * 3
    assert _health(adm, "node-a", "gpu0") == ("ejected", 3, 5.0)
    # While ejected, BIG falls back to gpu1 at once even though gpu0 is idle and preferred.
    await trio.sleep(4.5)
    async with adm.lease(BIG) as lease:
        assert lease.provider == pool.gpu1
    assert _health(adm, "node-a", "gpu0") == ("ejected", 3, 0.5)
    drain_check(adm)


async def test_probe_after_time_then_restore(autojump_clock, pool, spawn, drain_check):
    """[outlier-ejection] the ejection ends at exactly 5.0 s: a parked waiter gets the probe that
    instant (watch_ejections); the probe's success restores the provider."""
    adm = Admission(_outlier(pool.two_nodes()))
    adm.connect("node-a")
    adm.connect("node-b")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(adm.watch_ejections)
        t0 = trio.current_time()
        await _fail(adm, FAST, 3)  # FAST has only gpu0: panic mode, still admitted
        assert adm.snapshot().panic == (FAST,)
        async with adm.lease(BIG):  # BIG avoids the ejected gpu0: gpu1
            waiter = await spawn(nursery, adm, BIG)  # gpu1 busy, gpu0 ejected: it waits
            assert waiter.waiting
            await trio.sleep(4.75)
            assert waiter.waiting
            await trio.sleep(1.0)
            assert waiter.lease is not None and waiter.lease.probe
            assert waiter.granted_at - t0 == 5.0
            assert waiter.lease.provider == pool.gpu0
            assert adm.snapshot().provider("node-a", "gpu0").probes == 1
            adm.report_success(waiter.lease)
            assert _health(adm, "node-a", "gpu0") == ("online", 0, 0.0)
            assert adm.snapshot().panic == ()
            waiter.release.set()
        nursery.cancel_scope.cancel()
    drain_check(adm)


async def test_probe_failure_doubles_up_to_cap(autojump_clock, pool, drain_check):
    """[outlier-ejection] each ejection in a row doubles (5, 10, 20 -> capped at 15 s); only one probe per period."""
    adm = Admission(_outlier(pool.shared(capacity=2), cap=15.0))
    adm.connect("node-a")
    await _fail(adm, BIG, 3)
    for expected in (10.0, 15.0, 15.0):
        left = _health(adm, "node-a", "gpu0")[2]
        await trio.sleep(left)  # the ejection ends; no watcher: the next request advances
        async with adm.lease(BIG) as probe, adm.lease(BIG) as panic:
            assert probe.probe and not panic.probe  # one probe; the second is a panic-mode grant
            adm.report_failure(panic)  # only the probe decides
            assert _health(adm, "node-a", "gpu0")[::2] == ("ejected", 0.0)  # the probe runs
            adm.report_failure(probe)
        assert _health(adm, "node-a", "gpu0")[::2] == ("ejected", expected)
    assert adm.snapshot().provider("node-a", "gpu0").ejections == 4
    assert adm.snapshot().provider("node-a", "gpu0").probes == 3
    drain_check(adm)


async def test_stale_reports_change_nothing(autojump_clock, pool, drain_check):
    """[outlier-ejection] failures of leases granted before the ejection do not lengthen it;
    a second report of one lease and a report after the node reconnected count for nothing."""
    adm = Admission(_outlier(pool.shared(capacity=4), failures=2))
    adm.connect("node-a")
    async with adm.lease(BIG) as a, adm.lease(BIG) as b, adm.lease(BIG) as c:
        adm.report_failure(a)
        adm.report_failure(a)  # the same lease twice: once
        assert _health(adm, "node-a", "gpu0")[:2] == ("online", 1)
        adm.report_failure(b)
        assert _health(adm, "node-a", "gpu0") == ("ejected", 2, 5.0)
        await trio.sleep(1.0)
        adm.report_failure(c)  # granted before the ejection: stale
        adm.report_success(c)
        assert _health(adm, "node-a", "gpu0") == ("ejected", 2, 4.0)
    gen = adm.connect("node-a")  # reconnect: a new generation
    assert gen == 2
    await trio.sleep(4.0)
    with pytest.raises(LeaseRevoked):
        async with adm.lease(BIG) as probe:
            assert probe.probe
            adm.connect("node-a")  # fenced: the probe is revoked unreported; the next grant probes again
            adm.report_failure(probe)  # from a fenced generation: stale
    assert _health(adm, "node-a", "gpu0") == ("ejected", 2, 0.0)
    async with adm.lease(BIG) as probe2:
        assert probe2.probe
        adm.report_success(probe2)
    assert _health(adm, "node-a", "gpu0") == ("online", 0, 0.0)
    drain_check(adm)


async def test_panic_mode_admits_the_only_candidate(autojump_clock, pool, drain_check):
    """[outlier-ejection] a single-backend model is never turned into "all requests fail":
    while its only candidate is ejected, requests are still admitted to it (panic mode)."""
    adm = Admission(_outlier(pool.shared()))
    adm.connect("node-a")
    await _fail(adm, BIG, 3)
    assert adm.snapshot().panic == (BIG, FAST)
    async with adm.lease(FAST) as lease:
        assert lease.provider == pool.gpu0 and not lease.probe
        adm.report_success(lease)  # a panic-mode success restores it
    assert adm.snapshot().panic == ()
    assert _health(adm, "node-a", "gpu0") == ("online", 0, 0.0)
    drain_check(adm)


async def test_ejection_can_be_off(autojump_clock, pool, drain_check):
    """[outlier-ejection] consecutive_failures: 0 never ejects."""
    adm = Admission(_outlier(pool.shared(), failures=0))
    adm.connect("node-a")
    await _fail(adm, BIG, 10)
    assert _health(adm, "node-a", "gpu0") == ("online", 10, 0.0)
    drain_check(adm)


async def test_retry_keeps_arrival_place(autojump_clock, pool, spawn, drain_check):
    """[failover-before-first-byte] a retried request waits ahead of a later arrival for the provider
    it can use: when gpu0 frees up at t=3 the retry (arrived at t=0) gets it, not the newcomer (t=1)."""
    adm = Admission(pool.two_nodes())
    adm.connect("node-a")
    adm.connect("node-b")
    async with trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        assert holder.lease.provider == pool.gpu0
        async with adm.lease(BIG) as first:  # the attempt that will fail
            assert first.provider == pool.gpu1
            await trio.sleep(1.0)
            newcomer = await spawn(nursery, adm, FAST)  # FAST lists gpu0 only
            assert newcomer.waiting
        # The first attempt failed before any byte: gpu1 is excluded, gpu0 busy: queued ahead.
        results: list[Lease] = []
        done = trio.Event()

        async def retry() -> None:
            async with adm.retry(first, reason="upstream_5xx") as second:
                results.append(second)
                await done.wait()

        nursery.start_soon(retry)
        await trio.testing.wait_all_tasks_blocked()
        assert adm.snapshot().queue_depth == 2
        await trio.sleep(2.0)
        holder.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert [(r.provider, r.attempt, r.arrival) for r in results] == [(pool.gpu0, 2, first.arrival)]
        assert results[0].tried == (pool.gpu1, pool.gpu0)
        assert results[0].queue_wait == 2.0  # this attempt's wait: asked again at t=1
        assert newcomer.waiting
        done.set()
        await trio.testing.wait_all_tasks_blocked()
        assert newcomer.granted_at == 3.0
        newcomer.release.set()
    drain_check(adm)


async def test_retry_bounds(autojump_clock, pool, drain_check):
    """[failover-before-first-byte] never the same provider twice, at most max_attempts, only
    within the queue deadline."""
    adm = Admission(pool.two_nodes(queue_timeout=10.0))
    adm.connect("node-a")
    adm.connect("node-b")
    async with adm.lease(FAST) as only:  # FAST lists gpu0 only
        pass
    with pytest.raises(Unavailable):
        async with adm.retry(only):
            pass  # pragma: no cover
    async with adm.lease(BIG) as one:
        pass
    async with adm.retry(one) as two:
        assert two.provider != one.provider and two.attempt == 2
    with pytest.raises(RetriesExhausted):  # max_attempts 2
        async with adm.retry(two):
            pass  # pragma: no cover
    with pytest.raises(RuntimeError):
        async with adm.retry(one):
            pass  # pragma: no cover
    adm.refresh(attrs.evolve(adm.config, retry=RetryPolicy(max_attempts=3)))
    async with adm.lease(BIG) as late:
        await trio.sleep(10.0)
    with pytest.raises(QueueTimeout):
        async with adm.retry(late):
            pass  # pragma: no cover
    drain_check(adm)


async def test_health_events(autojump_clock, pool, drain_check):
    """[outlier-ejection] [failover-before-first-byte] events ejected, restored and retried."""
    adm = Admission(_outlier(pool.two_nodes(), failures=1))
    adm.connect("node-a")
    adm.connect("node-b")
    async with adm.subscribe() as events:
        async with adm.lease(BIG) as first:
            adm.report_failure(first)
        async with adm.retry(first, reason="upstream_5xx") as second:
            adm.report_success(second)
        await trio.sleep(5.0)
        async with adm.lease(FAST) as probe:
            adm.report_success(probe)
        got: list[AdmissionEvent] = []
        while True:
            try:
                event = events.receive_nowait()
            except trio.WouldBlock:
                break
            if event.kind in ("ejected", "restored", "retried"):
                got.append(event)
    assert [(e.kind, e.provider) for e in got] == [
        ("ejected", pool.gpu0),
        ("retried", pool.gpu0),
        ("restored", pool.gpu0),
    ]
    assert (got[0].duration, got[0].failures, got[0].time) == (5.0, 1, 0.0)
    assert (got[1].attempt, got[1].reason) == (2, "upstream_5xx")
    assert got[2].time == 5.0
    drain_check(adm)

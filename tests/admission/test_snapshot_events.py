"""Snapshot reads the state admission uses; events are best effort.

[snapshot-source] [lease-lifecycle] [cross-model-tests]
"""

from __future__ import annotations

import json

import cattrs
import pytest
import trio

from iop_admission import Admission, AdmissionEvent, QueueFull, Unavailable

BIG = "ornith:35b"
FAST = "ornith-fast"


@pytest.mark.req("snapshot-source")
async def test_candidate_pressure_vs_true_queue_depth(autojump_clock, pool, spawn, drain_check):
    """[snapshot-source] a waiter with two candidates counts at both providers (queued), the
    true queue depth counts it once; long waiters also count in long_queued."""
    adm = Admission(pool.two_nodes())
    adm.connect("node-a")
    adm.connect("node-b")
    async with trio.open_nursery() as nursery:
        holders = [await spawn(nursery, adm, BIG, long=True), await spawn(nursery, adm, BIG)]
        two = await spawn(nursery, adm, BIG, long=True)  # candidates gpu0 and gpu1
        one = await spawn(nursery, adm, FAST)  # candidate gpu0 only
        assert two.waiting and one.waiting
        snap = adm.snapshot()
        assert snap.queue_depth == 2
        gpu0, gpu1 = snap.provider("node-a", "gpu0"), snap.provider("node-b", "gpu1")
        assert (gpu0.queued, gpu0.long_queued) == (2, 1)
        assert (gpu1.queued, gpu1.long_queued) == (1, 1)
        assert sum(p.queued for p in snap.providers) > snap.queue_depth
        assert (gpu0.in_flight, gpu0.long_in_flight, gpu1.in_flight, gpu1.long_in_flight) == (1, 1, 1, 0)
        assert (snap.max_queue, snap.queue_timeout, snap.events_dropped) == (64, 30.0, 0)
        for r in (*holders, two, one):
            r.release.set()
    drain_check(adm)


@pytest.mark.req("snapshot-source")
async def test_snapshot_unstructures_to_json(autojump_clock, pool, spawn, drain_check):
    """[snapshot-source] cattrs.unstructure(snapshot) is the JSON /status serves."""
    adm = Admission(pool.two_nodes(gpu1=pool.spec(enabled=False)))
    adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        waiter = await spawn(nursery, adm, FAST)
        doc = json.loads(json.dumps(cattrs.unstructure(adm.snapshot())))
        assert doc["queue_depth"] == 1 and doc["events_dropped"] == 0
        assert [p["provider_id"] for p in doc["providers"]] == ["gpu0", "gpu1"]
        gpu0, gpu1 = doc["providers"]
        assert gpu0 == {
            "node_id": "node-a",
            "provider_id": "gpu0",
            "connected": True,
            "status": "available",
            "health": "online",
            "generation": 1,
            "capacity": 1,
            "long_context_capacity": 1,
            "effective_capacity": 1,
            "effective_long_capacity": 1,
            "in_flight": 1,
            "long_in_flight": 0,
            "queued": 1,
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
        }
        assert doc["panic"] == []
        assert (gpu1["status"], gpu1["health"], gpu1["connected"]) == ("disabled", "offline", False)
        for r in (holder, waiter):
            r.release.set()
    drain_check(adm)


@pytest.mark.req("lease-lifecycle")
async def test_events_lifecycle(autojump_clock, pool, spawn, drain_check):
    """[lease-lifecycle] subscribe() delivers connected, granted, queued, released, rejected,
    timed_out, revoked, disconnected and refreshed events."""
    adm = Admission(pool.shared(max_queue=1, queue_timeout=2.0))
    async with adm.subscribe(buffer=64) as events:
        gen = adm.connect("node-a")
        async with trio.open_nursery() as nursery:
            holder = await spawn(nursery, adm, BIG)
            waiter = await spawn(nursery, adm, FAST)
            full = await spawn(nursery, adm, BIG)  # queue of 1 is full
            assert isinstance(full.error, QueueFull)
            await waiter.done.wait()  # times out after 2 s
            adm.disconnect("node-a", gen)
        adm.refresh(pool.shared())
        got: list[AdmissionEvent] = []
        while True:
            try:
                got.append(events.receive_nowait())
            except trio.WouldBlock:
                break
    kinds = [e.kind for e in got]
    assert kinds == [
        "connected",
        "granted",
        "queued",
        "rejected",
        "timed_out",
        "revoked",
        "disconnected",  # emitted by disconnect() itself
        "released",  # when the fenced holder's task leaves its scope
        "refreshed",
    ]
    by_kind = {e.kind: e for e in got}
    assert by_kind["granted"].model == BIG and by_kind["granted"].provider == pool.gpu0
    assert by_kind["granted"].lease_id == holder.lease.id
    assert by_kind["rejected"].reason == "QueueFull"
    assert by_kind["timed_out"].waited == 2.0 and by_kind["timed_out"].model == FAST
    assert by_kind["revoked"].lease_id == holder.lease.id == by_kind["released"].lease_id
    assert by_kind["disconnected"].generation == gen
    assert adm.snapshot().events_dropped == 0
    drain_check(adm)


@pytest.mark.req("disconnect-queue-resolution")
async def test_rejected_event_for_unavailable(autojump_clock, pool, drain_check):
    """[disconnect-queue-resolution] an Unavailable answer is reported as a rejected event."""
    adm = Admission(pool.shared())
    async with adm.subscribe(buffer=4) as events:
        try:
            async with adm.lease(FAST):
                pass  # pragma: no cover
        except Unavailable:
            pass
        event = events.receive_nowait()
    assert (event.kind, event.model, event.reason) == ("rejected", FAST, "Unavailable")
    drain_check(adm)


@pytest.mark.req("lease-lifecycle", "cross-model-tests")
async def test_saturated_subscriber_changes_nothing(autojump_clock, pool, drain_check):
    """[lease-lifecycle] [cross-model-tests] a never-read subscriber with buffer 1 while 1,000
    leases of both groups cycle through 8 tasks: all complete, events are dropped and counted,
    every counter returns to 0."""
    adm = Admission(pool.shared(capacity=1, long_cap=1, max_queue=64))
    adm.connect("node-a")
    completed = 0

    async def worker(i: int) -> None:
        nonlocal completed
        for n in range(125):
            async with adm.lease((BIG, FAST)[(i + n) % 2], long=(n % 5 == 0)):
                await trio.sleep(2**-10)
            completed += 1

    async with adm.subscribe(buffer=1):
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(worker, i)
        elapsed = trio.current_time() - t0
    assert completed == 1000
    assert elapsed == 1000 * 2**-10  # capacity 1: fully serialised, no gap between leases
    assert adm.snapshot().events_dropped > 0
    drain_check(adm)

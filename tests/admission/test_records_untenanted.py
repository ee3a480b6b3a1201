"""Without tenants, a request that queued carries no tenant in its events: its ``queued`` event
and the events of the lease it is granted name no tenant (None), as the one granted at once.
[tenant-fair-share]"""

from __future__ import annotations

import trio
import trio.testing

from iop_admission import Admission

BIG = "ornith:35b"


async def test_queued_then_granted_request_names_no_tenant_without_tenants(autojump_clock, pool, spawn, drain_check):
    adm = Admission(pool.shared())
    adm.connect("node-a")
    async with adm.subscribe(buffer=64) as events, trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        waiter = await spawn(nursery, adm, BIG)
        holder.release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert waiter.lease is not None
        waiter.release.set()
        await trio.testing.wait_all_tasks_blocked()
        seen = []
        while True:
            try:
                event = events.receive_nowait()
            except trio.WouldBlock:
                break
            seen.append((event.kind, event.tenant))
    assert ("queued", None) in seen
    assert [kind for kind, _ in seen].count("granted") == 2
    assert {tenant for _, tenant in seen} == {None}
    drain_check(adm)

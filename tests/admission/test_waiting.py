"""Admission.waiters(): the queued requests, read only, from the state admission decides on.

[queue-page]
"""

from __future__ import annotations

import pytest
import trio

from iop_admission import Admission, ProviderKey

BIG = "ornith:35b"
FAST = "ornith-fast"
GPU0 = ProviderKey("node-a", "gpu0")
GPU1 = ProviderKey("node-b", "gpu1")


@pytest.mark.req("queue-page")
async def test_waiters_carry_order_position_age_and_candidates(autojump_clock, pool, spawn, drain_check):
    """[queue-page] order counts the whole queue, position the model key and kind; age grows
    with the clock; a granted waiter leaves the list."""
    adm = Admission(pool.two_nodes())
    adm.connect("node-a")
    adm.connect("node-b")
    async with trio.open_nursery() as nursery:
        holders = [await spawn(nursery, adm, BIG), await spawn(nursery, adm, BIG)]
        first = await spawn(nursery, adm, BIG)
        await trio.sleep(2.0)
        fast = await spawn(nursery, adm, FAST)
        second = await spawn(nursery, adm, BIG)
        long = await spawn(nursery, adm, BIG, long=True)
        waiting = adm.waiters()
        assert adm.snapshot().queue_depth == len(waiting) == 4
        got = [(w.order, w.position, w.model, w.long, w.attempt) for w in waiting]
        assert got == [(1, 1, BIG, False, 1), (2, 1, FAST, False, 1), (3, 2, BIG, False, 1), (4, 1, BIG, True, 1)]
        assert waiting[0].age == pytest.approx(2.0)
        assert waiting[1].age == pytest.approx(0.0)
        assert waiting[0].candidates == (GPU0, GPU1)
        assert waiting[1].candidates == (GPU0,)
        assert {w.tenant for w in waiting} == {"default"}  # no tenants configured
        holders[0].release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert [(w.order, w.position, w.model) for w in adm.waiters()][:2] == [(1, 1, FAST), (2, 1, BIG)]
        for r in (holders[1], first, fast, second, long):
            r.release.set()
    drain_check(adm)


@pytest.mark.req("queue-page")
async def test_waiters_is_empty_without_a_queue(autojump_clock, pool, spawn, drain_check):
    """[queue-page] nothing queued: no waiter snapshots, outside a trio loop too."""
    adm = Admission(pool.shared())
    assert adm.waiters() == ()
    adm.connect("node-a")
    async with trio.open_nursery() as nursery:
        holder = await spawn(nursery, adm, BIG)
        assert adm.waiters() == ()
        holder.release.set()
    drain_check(adm)

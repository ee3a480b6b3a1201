"""The head check in a cold burst, without sockets: the front door's tenant-blind count against
admission's own rule ([overload-cheap-reject], [tenant-quotas]).

Each case is a moment of a burst (issue 38): requests let through on their heads and not asking
yet (in transit) make the front door's count read a full queue. The count alone -- the head check
before this change -- refused the next request ``queue_full``; :func:`refuses_queue_full` asks as
admission would and lets it through.
"""

from __future__ import annotations

import pytest

from iop_admission import TenantSnapshot
from iop_edge.front_door.overload import FrontDoor, OverloadPolicy
from iop_edge.front_door.queue_room import refuses_queue_full

MAX_QUEUE, CAPACITY = 16, 4
NOW = 50.0


def row(name: str, *, priority: int = 0, waiting: int = 0, max_queue: int | None = None) -> TenantSnapshot:
    return TenantSnapshot(
        name=name,
        weight=1.0,
        priority=priority,
        max_in_flight=None,
        max_queue=max_queue,
        waiting=waiting,
        in_flight=0,
        grants=0,
        share=0.0,
        cost_charged=0.0,
    )


def busy_door(queued: int, transit: dict[str | None, int]) -> FrontDoor:
    """A front door with every slot leased, ``queued`` requests asking and ``transit`` let through."""
    door = FrontDoor(OverloadPolicy())
    door.running, door.waiting = CAPACITY, queued
    for tenant, count in transit.items():
        for _ in range(count):
            door.let_through(NOW, tenant)
    return door


@pytest.mark.req("overload-cheap-reject", "tenant-quotas")
def test_a_sheddable_flood_in_transit_turns_no_band_0_request_into_queue_full() -> None:
    """[tenant-quotas] 40 band -1 clients and 10 band 0 clients at once: 4 band 0 requests queued,
    12 band -1 requests let through and not queued yet. The count reads a full queue and (nothing
    sheddable queued yet) the old check refused the next band 0 request; admission would queue it,
    evicting one of the band -1 requests once they queue. The rows-and-transit rule lets it through."""
    door = busy_door(4, {"s": 12})
    rows = [row("default"), row("s", priority=-1), row("n", waiting=4)]
    assert door.queue_full(MAX_QUEUE, CAPACITY, queue_depth=4, now=NOW)  # the blind count: full
    assert not refuses_queue_full("n", rows, 4, MAX_QUEUE, door.in_transit(NOW))
    queued_s = [row("default"), row("s", priority=-1, waiting=12), row("n", waiting=4)]
    assert not refuses_queue_full("n", queued_s, 16, MAX_QUEUE, {})  # queued: evicted for it as well


@pytest.mark.req("overload-cheap-reject", "tenant-quotas")
def test_a_tenant_flooding_to_its_own_max_queue_turns_no_light_tenant_into_queue_full() -> None:
    """[tenant-quotas] A flooding tenant F (max_queue 8) has 8 queued and 8 more in transit; a light
    tenant L has 2 queued. The count reads 18 of 16; F's requests in transit can never queue (its
    quota), so admission would queue L's request: no refusal on the head."""
    door = busy_door(10, {"f": 8})
    rows = [row("default"), row("f", waiting=8, max_queue=8), row("l", waiting=2)]
    assert door.queue_full(MAX_QUEUE, CAPACITY, queue_depth=10, now=NOW)
    assert not refuses_queue_full("l", rows, 10, MAX_QUEUE, door.in_transit(NOW))
    door.enter("f")  # one of F's arrives (admission refuses it tenant_max_queue): no longer in transit
    assert door.in_transit(NOW) == {"f": 7}


@pytest.mark.req("overload-cheap-reject", "tenant-quotas")
def test_a_queue_really_full_of_non_sheddable_waiters_is_still_refused_on_the_head() -> None:
    """[overload-cheap-reject] What admission would refuse queue_full is still refused before the
    body: the queue full of band 0 waiters, or filled by what is in transit within its tenants'
    quotas, and nothing sheddable queued or on its way."""
    full = [row("default"), row("a", waiting=10), row("b", waiting=6)]
    assert refuses_queue_full("a", full, 16, MAX_QUEUE, {})
    assert refuses_queue_full(None, full, 16, MAX_QUEUE, {})  # no key: the default tenant's request
    filling = [row("default"), row("a", waiting=10, max_queue=12), row("b", waiting=2)]
    assert refuses_queue_full("b", filling, 12, MAX_QUEUE, {"a": 9, "b": 2})  # 12 + 2 (a's room) + 2
    assert not refuses_queue_full("b", filling, 12, MAX_QUEUE, {"a": 9, "b": 1})  # 12 + 2 + 1


@pytest.mark.req("tenant-quotas")
def test_requests_admission_answers_with_a_tenant_code_are_left_to_admission() -> None:
    """[tenant-quotas] A request of a negative band is never queue_full in admission (queued, or
    tenant_shed), nor one whose tenant is at its own max_queue counting its requests in transit
    (tenant_max_queue with its own Retry-After): the head lets both through."""
    rows = [row("default"), row("s", priority=-1), row("f", waiting=6, max_queue=8), row("n", waiting=10)]
    assert not refuses_queue_full("s", rows, 16, MAX_QUEUE, {})
    assert not refuses_queue_full("f", rows, 16, MAX_QUEUE, {"f": 2})
    assert refuses_queue_full("f", rows, 16, MAX_QUEUE, {"f": 1})
    assert not refuses_queue_full("unknown", [row("n", waiting=16)], 16, MAX_QUEUE, {})  # no row at all


@pytest.mark.req("overload-cheap-reject")
def test_in_transit_counts_by_tenant_lapse_and_leave_with_their_requests() -> None:
    """[overload-cheap-reject] The counts by tenant follow the total: each arrival or give-up takes
    one off its own tenant, and all lapse together after the passing window."""
    door = busy_door(0, {"a": 2, None: 1})
    door.gave_up("a")
    door.enter(None)
    assert (door.passing, door.in_transit(NOW)) == (1, {"a": 1})
    door.enter("b")  # a request not counted in transit by its tenant (decided before a lapse)
    assert (door.passing, door.in_transit(NOW)) == (0, {"a": 1})
    assert door.in_transit(door.passing_until + 1.0) == {}
    door.let_through(door.passing_until + 1.0, "b")
    assert door.in_transit(door.passing_until) == {"b": 1}

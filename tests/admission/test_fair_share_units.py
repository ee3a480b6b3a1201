"""Example tests of FairShare's bookkeeping that the fairness machine reaches rarely or not at all.

Each pins a figure the mutation run (docs/reliability.md) found unchecked: an at-once
grant (``admit``) charges what ``enqueue`` then ``grant`` would; ``settle`` moves the
tag by ``delta / weight`` and records the cost; a weight change rescales the lead;
the heap's compaction keeps the live entries.
"""

from __future__ import annotations

import pytest

from iop_admission import ConfigError, TenantLimitExceeded, TenantSpec
from iop_admission.core import FairShare


def _order(core: FairShare, count: int) -> list[str]:
    out = []
    for _ in range(count):
        ticket = core.grant()
        assert ticket is not None
        out.append(ticket.tenant)
    return out


@pytest.mark.req("tenant-fair-share")
@pytest.mark.parametrize("at_once", [True, False])
def test_admit_charges_what_enqueue_then_grant_would(at_once: bool) -> None:
    """b (weight 2) is served twice while a idles; then a's grant -- at once or queued -- starts
    at the band's virtual time (idle time banks no credit) and costs 3 / 2 of b's per unit."""
    core = FairShare([TenantSpec("a", weight=1), TenantSpec("b", weight=2)])
    for n in range(2):
        core.enqueue("b", f"b{n}", cost=3.0)
    assert _order(core, 2) == ["b", "b"]
    if at_once:
        ticket = core.admit("a", "a0", cost=3.0, seq=7)
    else:
        ticket, _ = core.enqueue("a", "a0", cost=3.0, seq=7)
        assert core.grant() is ticket
    assert (ticket.tenant, ticket.item, ticket.cost, ticket.seq, ticket.granted, ticket.charged) == (
        "a",
        "a0",
        3.0,
        7,
        True,
        3.0,
    )
    assert (core.served("a"), core.grants("a"), core.in_flight("a")) == (3.0, 1, 1)
    for n in range(4):
        core.enqueue("a", f"a{n + 1}", cost=1.0)
        core.enqueue("b", f"b{n + 2}", cost=1.0)
    # a started at V = 1.5 (b's second start), so its tag is 4.5; b's is 3.0 and moves by 0.5.
    assert _order(core, 8) == ["b", "b", "b", "a", "b", "a", "a", "a"]


@pytest.mark.req("tenant-fair-share")
def test_admit_counts_every_grant_and_its_cost() -> None:
    core = FairShare([TenantSpec("a")])
    for n in range(3):
        core.admit("a", n, cost=2.5)
    assert (core.served("a"), core.grants("a"), core.in_flight("a")) == (7.5, 3, 3)
    default = core.admit("a", "x")
    assert (default.cost, default.seq) == (1.0, 0)


@pytest.mark.req("tenant-fair-share")
def test_settle_moves_the_tag_by_the_difference_over_the_weight() -> None:
    """a (weight 2) reserved 2 and used 10: its tag moves by 8 / 2 = 4, so b (weight 1), from the
    same start, is served four times before a again; the ticket records the cost it used."""
    core = FairShare([TenantSpec("a", weight=2), TenantSpec("b", weight=1)])
    first, _ = core.enqueue("a", "a0", cost=2.0)
    assert core.grant() is first
    core.settle(first, 10.0)
    assert first.charged == 10.0
    assert core.served("a") == 10.0
    core.settle(first, 10.0)
    assert core.served("a") == 10.0
    core.enqueue("a", "a1")
    for n in range(6):
        core.enqueue("b", f"b{n}")
    # a's tag: 0 + 2 / 2 + 8 / 2 = 5; b starts at V = 0 and moves by 1; at 5 a's earlier arrival wins.
    assert _order(core, 7) == ["b", "b", "b", "b", "b", "a", "b"]


@pytest.mark.req("tenant-fair-share")
def test_weight_change_rescales_the_lead_over_the_band() -> None:
    """a is 4 ahead of its band's virtual time at weight 1; at weight 4 the lead is 1, so a
    newcomer b (weight 1) is served once before a, not four times, then they alternate by tag."""
    core = FairShare([TenantSpec("a"), TenantSpec("b")])
    core.admit("a", "a0", cost=4.0)
    core.enqueue("a", "a1", cost=4.0)
    assert core.grant() is not None  # a's start 4 is now the band's time; its tag 8
    core.configure([TenantSpec("a", weight=4), TenantSpec("b")])
    for n in range(4):
        core.enqueue("b", f"b{n}")
        core.enqueue("a", f"a{n + 2}")
    # a's tag: 4 + 4 * 1 / 4 = 5, then + 1 / 4 per grant; b's: 4, then + 1 (a wins the tie at 5).
    assert _order(core, 6) == ["b", "a", "b", "a", "a", "a"]


@pytest.mark.req("tenant-fair-share")
def test_heap_compaction_keeps_the_live_entries() -> None:
    """Many re-keys (each settle pushes a fresh heap entry) trigger the heap's compaction; the
    tenants with waiters are still served afterwards, in tag order."""
    core = FairShare([TenantSpec("a"), TenantSpec("b")])
    held = core.admit("a", "a0")
    core.enqueue("a", "a1")
    core.enqueue("b", "b0")
    for _ in range(200):
        core.settle(held, 1.0)
    assert _order(core, 2) == ["b", "a"]
    assert core.grant() is None


@pytest.mark.req("tenant-fair-share")
def test_choose_names_the_next_grant_without_granting_it() -> None:
    """``choose`` is ``grant``'s choice, predicate included, and leaves the order as it was."""
    core = FairShare([TenantSpec("a"), TenantSpec("b")])
    a0, _ = core.enqueue("a", "a0")
    b0, _ = core.enqueue("b", "b0")
    assert core.choose(lambda item: item != "a0") is b0
    assert core.choose(lambda item: True) is a0
    assert core.choose(lambda item: True) is a0
    assert not a0.granted and core.in_flight("a") == 0
    assert core.grant() is a0
    assert core.choose(lambda item: True) is b0


@pytest.mark.req("tenant-fair-share")
def test_admit_charges_cost_over_weight() -> None:
    """a (weight 4) granted at once for cost 2 is at tag 0.5: b, at 0, then a, then b again."""
    core = FairShare([TenantSpec("a", weight=4), TenantSpec("b")])
    core.admit("a", "a0", cost=2.0)
    core.enqueue("b", "b0")
    core.enqueue("b", "b1")
    core.enqueue("a", "a1")
    assert _order(core, 3) == ["b", "a", "b"]


@pytest.mark.req("tenant-fair-share")
def test_a_refund_does_not_move_the_tag_behind_the_band_time() -> None:
    """a reserved 10 and used nothing while b was served five times (the band's time is 4); a
    has waiters when the refund comes: its tag goes back to 4, not 0, so a and b alternate
    instead of a being served first three times."""
    core = FairShare([TenantSpec("a"), TenantSpec("b")])
    held = core.admit("a", "a0", cost=10.0)
    for n in range(5):
        core.enqueue("b", f"b{n}")
    assert _order(core, 5) == ["b"] * 5
    for n in range(3):
        core.enqueue("b", f"b{n + 5}")
    for n in range(3):
        core.enqueue("a", f"a{n + 1}")  # a is backlogged: its next enqueue will not lift its tag
    core.settle(held, 0.0)
    assert core.served("a") == 0.0
    # a at 4 is served first; then each tie goes to b, whose waiters arrived first.
    assert _order(core, 6) == ["a", "b", "a", "b", "a", "b"]


@pytest.mark.req("tenant-fair-share")
@pytest.mark.parametrize(("priority", "limit"), [(0, "queue"), (-1, "shed")])
def test_full_queue_refusal_names_the_tenant_the_limit_and_its_size(priority: int, limit: str) -> None:
    """With the whole queue full and nothing of a lower negative band to shed, a newcomer is
    refused: ``queue`` for a band >= 0, ``shed`` for a negative one; the error names both."""
    core = FairShare([TenantSpec("a", priority=priority), TenantSpec("b")], queue_limit=2)
    core.enqueue("b", "b0")
    core.enqueue("b", "b1")
    with pytest.raises(TenantLimitExceeded) as refused:
        core.enqueue("a", "a0")
    assert (refused.value.tenant, refused.value.limit, refused.value.value) == ("a", limit, 2)


@pytest.mark.req("tenant-fair-share")
def test_tenant_spec_lists_every_problem() -> None:
    with pytest.raises(ConfigError) as bad:
        TenantSpec("", weight=0, max_in_flight=0)
    assert bad.value.problems == (
        "tenant name must not be empty",
        "tenant '': weight must be > 0",
        "tenant '': max_in_flight must be >= 1",
    )


@pytest.mark.req("tenant-fair-share")
@pytest.mark.parametrize("holds", ["queue", "lease", "both"])
def test_tenant_dropped_from_the_config_keeps_its_waiters_and_leases(holds: str) -> None:
    """x leaves the config while it has a waiter, a lease or both: it stays, under the default
    tenant's spec and its own name, until they leave, then it is gone; a tenant with neither is gone at
    once; new items naming it go to the default tenant meanwhile."""
    core = FairShare([TenantSpec("x", weight=5, max_in_flight=3), TenantSpec("idle")])
    held = core.admit("x", "x0") if holds in ("lease", "both") else None
    waiting = core.enqueue("x", "x1")[0] if holds in ("queue", "both") else None
    core.configure([TenantSpec("default", weight=2)])
    assert core.tenants() == ["x", "default"]
    assert core.spec("x") == TenantSpec("x", weight=2)
    if waiting is not None:
        assert core.grant() is waiting
    assert core.tenant_of("x") == "default"
    if held is not None:
        core.release(held)
    if waiting is not None:
        assert core.in_flight("x") == 1
        core.release(waiting)
    assert core.tenants() == ["default"]


@pytest.mark.req("tenant-fair-share")
def test_release_counts_once_and_only_granted_tickets() -> None:
    core = FairShare([TenantSpec("a", max_in_flight=1)])
    held = core.admit("a", "a0")
    queued, _ = core.enqueue("a", "a1")
    core.release(queued)  # not granted: nothing to free
    assert core.in_flight("a") == 1
    assert core.grant() is None  # a is at its max_in_flight
    core.release(held)
    core.release(held)
    assert core.in_flight("a") == 0
    assert core.grant() is queued


@pytest.mark.req("tenant-fair-share")
def test_shedding_takes_the_newest_waiter_of_the_lowest_negative_band_below() -> None:
    """Under a full queue a newcomer evicts the newest waiter of the lowest negative band below
    its own; nothing of band 0 or above is ever shed, nor anything of the newcomer's band."""
    core = FairShare(
        [TenantSpec("top", priority=1), TenantSpec("low", priority=-2), TenantSpec("mid", priority=-1)],
        queue_limit=4,
    )
    low0, _ = core.enqueue("low", "l0")
    low1, _ = core.enqueue("low", "l1")
    core.enqueue("mid", "m0")
    core.enqueue("mid", "m1")
    assert core.enqueue("top", "t0")[1] == [low1]
    assert core.enqueue("default", "d0")[1] == [low0]
    with pytest.raises(TenantLimitExceeded) as refused:  # only mid (-1) is left below 0: not below -1
        core.enqueue("mid", "m2")
    assert refused.value.limit == "shed"
    assert [t.item for t in core.enqueue("top", "t1")[1]] == ["m1"]
    assert [t.item for t in core.enqueue("top", "t2")[1]] == ["m0"]
    with pytest.raises(TenantLimitExceeded) as refused:  # bands 0 and 1 only: nothing to shed
        core.enqueue("top", "t3")
    assert refused.value.limit == "queue"


@pytest.mark.req("tenant-fair-share")
def test_shedding_compares_bands_first_then_arrival_across_tenants() -> None:
    """mid (-1) holds the newest waiter, lowa and lowb (-2) older ones: the lowest band goes
    first, and within it the newest waiter of either tenant; mid's waiter last."""
    core = FairShare(
        [TenantSpec("mid", priority=-1), TenantSpec("lowa", priority=-2), TenantSpec("lowb", priority=-2)],
        queue_limit=4,
    )
    for tenant, item in (("lowa", "a0"), ("lowb", "b0"), ("lowa", "a1"), ("mid", "m0")):
        core.enqueue(tenant, item)
    shed = [[t.item for t in core.enqueue("default", f"d{n}")[1]] for n in range(4)]
    assert shed == [["a1"], ["b0"], ["a0"], ["m0"]]
    with pytest.raises(TenantLimitExceeded):
        core.enqueue("default", "d4")

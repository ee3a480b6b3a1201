"""FairShare's virtual times at the edges: a tenant passed over, a tenant moved to a fresh band.

Example tests of what the mutation run (docs/reliability.md) found unchecked:

* a backlogged tenant whose waiter the predicate passes over keeps its tag while the
  others are served past it; when it is served (queued, or at once) it starts from its
  own tag, and the band's virtual time does not move back for it;
* a tenant the config moves into a band where nobody was served yet carries its lead
  over its old band into it, and a refund or a second respec there counts from 0, the
  virtual time of a band before its first grant.
"""

from __future__ import annotations

import pytest

from iop_admission import TenantSpec
from iop_admission.core import FairShare


def _order(core: FairShare, count: int) -> list[str]:
    out = []
    for _ in range(count):
        ticket = core.grant()
        assert ticket is not None
        out.append(str(ticket.item))
    return out


@pytest.mark.req("tenant-fair-share")
@pytest.mark.parametrize("at_once", [False, True])
def test_passed_over_tenant_is_served_from_its_own_tag(at_once: bool) -> None:
    """a's only waiter cannot run while b is served three times (the band's time reaches 2,
    b's tag 3); a's next grant, of that waiter or at once, starts at a's tag 0, not at 2,
    and the band's time stays 2, where the newcomer c starts."""
    core = FairShare([TenantSpec("a"), TenantSpec("b"), TenantSpec("c")])
    core.enqueue("a", "a-blocked")
    for n in range(3):
        core.enqueue("b", f"b{n}")
    served = [core.grant(lambda item: item != "a-blocked") for _ in range(3)]
    assert [t.item for t in served if t is not None] == ["b0", "b1", "b2"]
    if at_once:
        core.admit("a", "a-now")  # a's tag 0 -> 1; its blocked waiter stays queued
    else:
        first = core.grant()
        assert first is not None and first.item == "a-blocked"
    core.enqueue("a", "a1")
    core.enqueue("c", "c0")
    core.enqueue("c", "c1")
    core.enqueue("b", "b3")
    # Queued: a's tag 1 -> a1 comes after the band's time, at 2. At once: a-blocked is still
    # queued, so a1 joins a's backlog at tag 1 + 1 = 2. c starts at the band's time 2, b at 3;
    # ties go to the earlier head.
    expected = ["a-blocked", "a1"] if at_once else ["a1"]
    assert _order(core, len(expected) + 3) == [*expected, "c0", "c1", "b3"]


@pytest.mark.req("tenant-fair-share")
def test_tenant_moved_to_a_fresh_band_carries_its_lead_there() -> None:
    """a is served once in band 0 (tag 1, band time 0), then moved to band 1, where nobody was
    served yet (time 0): its tag is its lead, 1. A refund of half brings it to 0.5; weight 2
    halves that lead to 0.25. The newcomer c of band 1 starts at 0: c first, then a twice
    (0.25, 0.75), then c (1) before a (1.25)."""
    core = FairShare([TenantSpec("a"), TenantSpec("c", priority=1)])
    held = core.admit("a", "a0")
    core.configure([TenantSpec("a", priority=1), TenantSpec("c", priority=1)])
    core.settle(held, 0.5)
    core.configure([TenantSpec("a", priority=1, weight=2.0), TenantSpec("c", priority=1)])
    for n in range(3):
        core.enqueue("a", f"a{n + 1}")
    for n in range(2):
        core.enqueue("c", f"c{n}")
    assert _order(core, 5) == ["c0", "a1", "a2", "c1", "a3"]


@pytest.mark.req("tenant-fair-share")
def test_grant_at_once_in_a_fresh_band_starts_at_zero() -> None:
    """c is served at once first in band 1 (start 0, tag 1); a, moved there with a lead of 0.5
    (tag 0.5, then + 0.5 a grant), is served once before c's next waiter, which wins the tie
    at 1 by arrival."""
    core = FairShare([TenantSpec("a", weight=2.0), TenantSpec("c", priority=1)])
    core.admit("a", "a0")  # band 0: a's tag 0.5, time 0
    core.configure([TenantSpec("a", priority=1, weight=2.0), TenantSpec("c", priority=1)])
    core.admit("c", "c0")
    core.enqueue("c", "c1")
    core.enqueue("a", "a1")
    core.enqueue("a", "a2")
    core.enqueue("a", "a3")
    assert _order(core, 4) == ["a1", "c1", "a2", "a3"]


@pytest.mark.req("tenant-token-cost")
def test_refund_in_a_fresh_band_brings_the_tag_back_to_its_start() -> None:
    """a's lease, granted in band 0 (tag 1), is settled at 0 after a moved to band 1, where
    nobody was served yet: a's tag goes back to 0, that band's time, level with the newcomer
    c; c, queued first, wins the ties."""
    core = FairShare([TenantSpec("a"), TenantSpec("c", priority=1)])
    held = core.admit("a", "a0")
    core.configure([TenantSpec("a", priority=1), TenantSpec("c", priority=1)])
    core.settle(held, 0.0)
    core.enqueue("c", "c0")
    core.enqueue("c", "c1")
    core.enqueue("a", "a1")
    core.enqueue("a", "a2")
    assert _order(core, 4) == ["c0", "a1", "c1", "a2"]


@pytest.mark.req("tenant-fair-share")
def test_a_passed_over_waiter_that_leaves_takes_its_tenants_credit_with_it() -> None:
    """a's only waiter cannot run while b is served three times (the band's time reaches 2, a's
    tag stays 0). a queues two more, then its passed-over waiter leaves unserved (a timeout):
    a's tag is lifted to the band's time, so d, queued at that time before a's newcomers, is
    served first -- a's newcomers do not spend the place of a waiter that never ran."""
    core = FairShare([TenantSpec("a"), TenantSpec("b"), TenantSpec("d")])
    blocked, _ = core.enqueue("a", "a-blocked")
    for n in range(3):
        core.enqueue("b", f"b{n}")
    served = [core.grant(lambda item: item != "a-blocked") for _ in range(3)]
    assert [t.item for t in served if t is not None] == ["b0", "b1", "b2"]
    core.enqueue("d", "d0")
    core.enqueue("a", "a1")
    core.enqueue("a", "a2")
    core.cancel(blocked)
    assert _order(core, 3) == ["d0", "a1", "a2"]

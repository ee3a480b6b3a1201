"""waiter_snapshots() over the core's queue: each field of a WaiterSnapshot (arrival number,
order, position, age, attempt, candidates, tenant), a retry's own candidates, the one shared
candidate tuple of a model key's first attempts, and an age never below 0. [queue-page]"""

from __future__ import annotations

import attrs
from tests.admission.steps import as_lease as _lease
from tests.admission.steps import as_waiter as _waiter

from iop_admission import TenantSpec, WaiterSnapshot
from iop_admission.core import AdmissionState, waiter_snapshots

BIG = "ornith:35b"
FAST = "ornith-fast"


def _core(config) -> AdmissionState:
    core = AdmissionState(config)
    core.connect("node-a")
    core.connect("node-b")
    return core


def test_every_field_of_first_attempts_and_of_a_queued_retry(pool):
    """A queued retry keeps its arrival number and place, its attempt, and lists only its
    untried candidates; first attempts of one model key share one candidate tuple."""
    core = _core(pool.two_nodes(gpu1=pool.spec(priority=-1)))
    first = _lease(core.request(BIG, False, 0.0))
    second = _lease(core.request(BIG, False, 0.0))
    a = _waiter(core.request(BIG, False, 1.0))
    core.release(first)  # gpu0 goes to a
    core.retry(first, 1.5)  # gpu0 tried, gpu1 busy: queued at arrival place 1
    b = _waiter(core.request(BIG, False, 2.0))
    c = _waiter(core.request(BIG, False, 2.5))
    got = waiter_snapshots(core.waiters(), 3.0, core.config.models)
    assert got == (
        WaiterSnapshot(1, 1, 1, BIG, False, 3.0, 2, (pool.gpu1,), "default"),
        WaiterSnapshot(b.seq, 2, 2, BIG, False, 1.0, 1, (pool.gpu0, pool.gpu1), "default"),
        WaiterSnapshot(c.seq, 3, 3, BIG, False, 0.5, 1, (pool.gpu0, pool.gpu1), "default"),
    )
    assert (a.state.value, second.released) == ("granted", False)
    assert got[1].candidates is got[2].candidates is core.config.models[BIG].candidates


def test_age_is_never_below_zero(pool):
    """Asked for an instant before a waiter queued, its age reads 0, not a negative number."""
    core = _core(pool.shared())
    _lease(core.request(BIG, False, 0.0))
    _waiter(core.request(BIG, False, 5.0))
    [early] = waiter_snapshots(core.waiters(), 4.0, core.config.models)
    assert early.age == 0.0
    [later] = waiter_snapshots(core.waiters(), 5.5, core.config.models)
    assert later.age == 0.5


def test_tenant_of_each_waiter(pool):
    """With tenants configured, each waiter names the tenant it is charged to."""
    config = attrs.evolve(pool.shared(), tenants=(TenantSpec("alpha"), TenantSpec("beta")))
    core = AdmissionState(config)
    core.connect("node-a")
    _lease(core.request(BIG, False, 0.0, tenant="alpha"))
    _waiter(core.request(BIG, False, 0.0, tenant="beta"))
    _waiter(core.request(FAST, False, 0.0))
    got = waiter_snapshots(core.waiters(), 0.0, core.config.models)
    assert [(w.model, w.tenant) for w in got] == [(BIG, "beta"), (FAST, "default")]

"""Tenant states the machines reached too rarely, pinned with exact steps through ``AdmissionState``.

Each test is the scenario of a semantic bug that passed the suite before (issue 44): a tenant's own
``max_queue`` checked after a full-queue shed (another tenant's waiter shed for a request refused
anyway); ``settle`` ignored once the lease was released or fenced; a band move that keeps the tag
against the old band's virtual time; an at-once grant that neither raises its band's virtual time
nor re-keys its tenant; a dropped tenant that keeps charging new requests.
"""

from __future__ import annotations

import pytest
from tests.admission.steps import as_lease as _lease
from tests.admission.steps import as_waiter as _waiter

from iop_admission import (
    ModelGroup,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    QueuePolicy,
    TenantLimitExceeded,
    TenantSpec,
)
from iop_admission.core import AdmissionState, Granted, Lease, WaiterState

QUEUED = WaiterState.QUEUED

A = ProviderKey("node-a", "gpu0")
M = "m"


def _config(
    tenants: tuple[TenantSpec, ...], *, capacity: int = 1, long_cap: int = 0, max_queue: int = 64
) -> PoolConfig:
    return PoolConfig(
        policy=QueuePolicy(max_queue=max_queue, queue_timeout=60.0),
        providers={A: ProviderSpec(capacity=capacity, long_context_capacity=long_cap)},
        models={M: ModelGroup(candidates=(A,))},
        tenants=tenants,
    )


def _state(config: PoolConfig) -> AdmissionState:
    state = AdmissionState(config)
    state.connect("node-a")
    return state


def _row(state: AdmissionState, name: str) -> tuple[int, int, float]:
    """``(waiting, in_flight, cost_charged)`` of tenant ``name``."""
    (row,) = (r for r in state.tenant_snapshots() if r.name == name)
    return row.waiting, row.in_flight, row.cost_charged


def _grant_order(state: AdmissionState, holder: Lease, names: str) -> str:
    """Queue one request per letter of ``names`` (its tenant) behind ``holder`` on the one slot, then
    release ``holder`` and each lease granted after it: the tenants in the order they were granted."""
    for name in names:
        _waiter(state.request(M, False, 0.0, name))
    order = ""
    lease = holder
    while True:
        decisions = state.release(lease)
        if not decisions:
            return order
        (grant,) = decisions
        assert isinstance(grant, Granted)
        lease = grant.lease
        order += lease.tenant


@pytest.mark.req("tenant-quotas")
def test_a_tenant_at_its_max_queue_is_refused_before_a_full_queue_sheds_anyone() -> None:
    """The queue is full and a lower band's waiter could be shed, but the newcomer's own tenant is at
    its ``max_queue``: it is refused, and the lower waiter keeps its place (nothing is drained)."""
    state = _state(
        _config((TenantSpec("hi", max_queue=1), TenantSpec("low", priority=-1)), max_queue=2),
    )
    _lease(state.request(M, False, 0.0, "hi"))
    low = _waiter(state.request(M, False, 0.0, "low"))
    _waiter(state.request(M, False, 0.0, "hi"))
    with pytest.raises(TenantLimitExceeded) as refused:
        state.request(M, False, 1.0, "hi")
    assert refused.value.limit == "max_queue"
    assert state.drain_decisions() == []
    assert low.state is QUEUED and _row(state, "low")[0] == 1


@pytest.mark.req("tenant-token-cost")
@pytest.mark.parametrize("end", ["released", "fenced"])
def test_settle_after_the_lease_ended_charges_the_usage_not_the_reserve(end: str) -> None:
    """[tenant-token-cost] a run settles once it ended, before or after the release: a released or
    fenced lease settled to 0 leaves its tenant charged 0, not its whole reserve."""
    state = _state(_config((TenantSpec("t"),), capacity=2))
    lease = _lease(state.request(M, False, 0.0, "t", 500.0))
    assert _row(state, "t") == (0, 1, 500.0)
    if end == "released":
        assert state.release(lease) == []
    else:
        ok, _ = state.disconnect("node-a", lease.generation)
        assert ok and lease.revoked
    state.settle(lease, 0.0)
    assert _row(state, "t") == (0, 0, 0.0)
    assert lease.cost == 0.0


@pytest.mark.req("tenant-fair-share")
def test_a_band_move_starts_the_tenant_at_its_new_bands_virtual_time() -> None:
    """``c`` waits in band -1 while ``a`` is served ten grants in band 0; then ``c`` moves into band 0
    with its waiters: its tag starts at band 0's virtual time (its lead over band -1's, none, kept),
    so the two interleave (ties go to ``c``'s earlier arrivals), not three of ``c`` first (``cccaaa``:
    the tag left at band -1's time)."""
    state = _state(_config((TenantSpec("a"), TenantSpec("c", priority=-1))))
    lease = _lease(state.request(M, False, 0.0, "a"))
    for name in "aaaaaaaaaaccc":
        _waiter(state.request(M, False, 0.0, name))
    for _ in range(10):
        [grant] = state.release(lease)
        assert isinstance(grant, Granted) and grant.lease.tenant == "a"
        lease = grant.lease
    assert state.refresh(_config((TenantSpec("a"), TenantSpec("c")))) == []
    assert _grant_order(state, lease, "aaa") == "ccacaa"


@pytest.mark.req("tenant-fair-share")
def test_an_at_once_grant_moves_its_bands_virtual_time() -> None:
    """Ten grants of ``a`` made at once move band 0's virtual time: ``b``, idle until now, banks no
    credit for them and alternates with ``a`` (not three of ``b`` first)."""
    state = _state(_config((TenantSpec("a"), TenantSpec("b"))))
    for _ in range(10):
        assert state.release(_lease(state.request(M, False, 0.0, "a"))) == []
    holder = _lease(state.request(M, False, 0.0, "a"))
    assert _grant_order(state, holder, "aaabbb") == "babab" + "a"


@pytest.mark.req("tenant-quotas")
def test_an_at_once_grant_at_the_tenants_cap_holds_its_long_waiter_back() -> None:
    """``t`` (``max_in_flight`` 1) waits for the long slot, then gets a normal slot at once: it is at
    its cap, so the freed long slot does not give it a second lease; its own release does."""
    state = _state(_config((TenantSpec("x"), TenantSpec("t", max_in_flight=1)), capacity=3, long_cap=1))
    x_long = _lease(state.request(M, True, 0.0, "x"))
    t_long = _waiter(state.request(M, True, 0.0, "t"))
    t_normal = _lease(state.request(M, False, 0.0, "t"))
    assert state.release(x_long) == []
    assert t_long.state is QUEUED and _row(state, "t") == (1, 1, 1.0)
    [grant] = state.release(t_normal)
    assert isinstance(grant, Granted) and grant.waiter is t_long and grant.lease.long
    assert state.release(grant.lease) == []


@pytest.mark.req("tenant-quotas", "refresh-consistency")
@pytest.mark.parametrize("prepared", [False, True])
def test_a_dropped_tenants_new_requests_go_to_default_and_its_waiters_keep_their_place(prepared: bool) -> None:
    """A refresh drops ``t`` while it holds a lease and has a waiter: its next request is charged to
    ``default`` at once (so a dropped tenant with steady traffic goes away); its waiter stays queued,
    is granted as ``t``, and ``t``'s row is gone once its last lease is released."""
    state = _state(_config((TenantSpec("t", weight=2.0),)))
    running = _lease(state.request(M, False, 0.0, "t"))
    queued = _waiter(state.request(M, False, 0.0, "t"))
    target = _config((TenantSpec("u"),))
    assert state.refresh(state.prepare_refresh(target) if prepared else target) == []
    newcomer = _waiter(state.request(M, False, 1.0, "t"))
    assert newcomer.tenant == "default"
    assert _row(state, "t")[:2] == (1, 1)
    granted: dict[object, str] = {}
    lease = running
    while decisions := state.release(lease):
        (grant,) = decisions
        assert isinstance(grant, Granted)
        granted[grant.waiter] = lease_tenant = grant.lease.tenant
        assert lease_tenant == grant.waiter.tenant
        lease = grant.lease
    assert granted == {queued: "t", newcomer: "default"}
    assert [row.name for row in state.tenant_snapshots()] == ["u", "default"]

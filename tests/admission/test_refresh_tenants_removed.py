"""A refresh that removes every tenant: one global FIFO again, live leases and waiters kept.

Sans-I/O tests with exact steps: the waiter a tenant's cap held back is granted by the refresh
itself (prepared or direct); leases and waiters from the tenants' time hold no ticket after it,
so when tenants come back their releases free nothing twice and break nothing.
"""

from __future__ import annotations

import pytest
from tests.admission.steps import as_lease as _lease
from tests.admission.steps import as_waiter as _waiter

from iop_admission import ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy, TenantSpec
from iop_admission.core import AdmissionState, Granted

A = ProviderKey("node-a", "gpu0")
M = "m"


def _config(tenants: tuple[TenantSpec, ...]) -> PoolConfig:
    return PoolConfig(
        policy=QueuePolicy(queue_timeout=60.0),
        providers={A: ProviderSpec(capacity=2, long_context_capacity=0)},
        models={M: ModelGroup(candidates=(A,))},
        tenants=tenants,
    )


def _state(tenants: tuple[TenantSpec, ...]) -> AdmissionState:
    state = AdmissionState(_config(tenants))
    state.connect("node-a")
    return state


@pytest.mark.req("tenant-quotas", "refresh-consistency")
@pytest.mark.parametrize("prepared", [False, True])
def test_refresh_removing_tenants_grants_the_waiter_a_cap_held_back(prepared: bool) -> None:
    state = _state((TenantSpec("t", max_in_flight=1),))
    _lease(state.request(M, False, 0.0, "t"))
    capped = _waiter(state.request(M, False, 0.0, "t"))  # gpu0 has room: t's cap holds it
    target = _config(())
    decisions = state.refresh(state.prepare_refresh(target) if prepared else target)
    assert [(d.waiter, d.lease.provider) for d in decisions if isinstance(d, Granted)] == [(capped, A)]


@pytest.mark.req("tenant-quotas", "refresh-consistency")
def test_leases_from_before_tenants_were_removed_release_cleanly_when_tenants_come_back() -> None:
    """A lease held through the tenants' removal and return, and the lease a waiter of the tenants'
    time got while none were configured, release without error; the tenant then runs two again."""
    tenants = (TenantSpec("t"),)
    state = _state(tenants)
    kept = _lease(state.request(M, False, 0.0, "t"))
    freed = _lease(state.request(M, False, 0.0, "t"))
    waiting = _waiter(state.request(M, False, 0.0, "t"))
    assert state.refresh(_config(())) == []
    [grant] = state.release(freed)
    assert isinstance(grant, Granted) and grant.waiter is waiting
    assert state.refresh(_config(tenants)) == []
    assert state.release(kept) == []
    assert state.release(grant.lease) == []
    assert [_lease(state.request(M, False, 1.0, "t")).provider for _ in range(2)] == [A, A]

"""Waiters already queued when a refresh configures tenants get tickets as they are.

Sans-I/O example tests of what the mutation run (docs/reliability.md) found unchecked in
``Tenancy.requeue``: a waiter's ticket keeps its arrival number (so a retry queued later
still goes in front of it), its reserved cost, and the tenant it was charged to before a
spell without tenants.
"""

from __future__ import annotations

import pytest

from iop_admission import ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy, TenantSpec
from iop_admission.core import AdmissionState, Granted, Lease, Waiter

A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-b", "gpu1")


def _config(tenants: tuple[TenantSpec, ...]) -> PoolConfig:
    spec = ProviderSpec(capacity=1, long_context_capacity=0)
    return PoolConfig(
        policy=QueuePolicy(queue_timeout=1e9),
        providers={A: spec, B: spec},
        models={"m": ModelGroup(candidates=(A, B))},
        tenants=tenants,
    )


def _grants(decisions: list[object]) -> list[tuple[Waiter, ProviderKey]]:
    return [(d.waiter, d.lease.provider) for d in decisions if isinstance(d, Granted)]


@pytest.mark.req("tenant-fair-share")
def test_retry_after_tenants_came_keeps_its_place_before_an_older_waiter() -> None:
    """A waiter queued before tenants were configured keeps its arrival number in its ticket: a
    retry of an earlier request, queued after, goes in front of it and takes the freed slot."""
    state = AdmissionState(_config(()))
    for node in state.nodes():
        state.connect(node)
    first, second = state.request("m", False, 0.0), state.request("m", False, 0.0)
    waiter = state.request("m", False, 0.0)
    assert isinstance(first, Lease) and isinstance(second, Lease) and isinstance(waiter, Waiter)
    assert state.refresh(_config((TenantSpec("x"),))) == []
    retry = state.retry(first, 0.0)  # B only, and B is busy
    assert isinstance(retry, Waiter) and retry.seq < waiter.seq
    assert _grants(state.release(second)) == [(retry, B)]
    assert _grants(state.release(first)) == [(waiter, A)]


@pytest.mark.req("tenant-fair-share")
def test_waiter_keeps_its_tenant_and_cost_across_a_spell_without_tenants() -> None:
    """Tenant gold's waiter (cost 3) stays queued while the tenants are removed and configured
    again: it is gold's waiter again, and its grant is charged 3 to gold."""
    tenants = (TenantSpec("gold"),)
    state = AdmissionState(_config(tenants))
    for node in state.nodes():
        state.connect(node)
    held = [state.request("m", False, 0.0, "gold") for _ in range(2)]
    waiter = state.request("m", False, 0.0, "gold", cost=3.0)
    assert isinstance(waiter, Waiter) and all(isinstance(lease, Lease) for lease in held)
    assert state.refresh(_config(())) == []
    assert state.refresh(_config(tenants)) == []
    assert {row.name: row.waiting for row in state.tenant_snapshots()} == {"gold": 1, "default": 0}
    [(granted, _provider)] = _grants(state.release(held[0]))
    assert granted is waiter and waiter.lease is not None
    assert (waiter.lease.tenant, waiter.lease.cost) == ("gold", 3.0)
    rows = {row.name: (row.grants, row.cost_charged) for row in state.tenant_snapshots()}
    assert rows == {"gold": (1, 3.0), "default": (0, 0.0)}

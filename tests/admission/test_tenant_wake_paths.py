"""A tenant's slot freed by a path other than a plain release wakes its waiters in every group.

Sans-I/O tests with exact steps of the two paths the mutation run (docs/reliability.md)
found unchecked: a node's disconnect fences a tenant's lease, and the release of a lease
on a provider the config removed. Tenant ``t`` may hold one lease; its waiter for model
``n`` (on another node) waits for that slot, not for capacity.
"""

from __future__ import annotations

import pytest

from iop_admission import ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy, TenantSpec
from iop_admission.core import AdmissionState, Granted, Lease, Waiter

A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-b", "gpu1")
TENANTS = (TenantSpec("t", max_in_flight=1),)


def _config(with_a: bool = True) -> PoolConfig:
    providers = {B: ProviderSpec(capacity=2, long_context_capacity=0)}
    models = {"n": ModelGroup(candidates=(B,))}
    if with_a:
        providers[A] = ProviderSpec(capacity=2, long_context_capacity=0)
        models["m"] = ModelGroup(candidates=(A,))
    return PoolConfig(policy=QueuePolicy(queue_timeout=1e9), providers=providers, models=models, tenants=TENANTS)


def _held_and_waiting() -> tuple[AdmissionState, Lease, Waiter]:
    state = AdmissionState(_config())
    for node in state.nodes():
        state.connect(node)
    held = state.request("m", False, 0.0, "t")
    waiting = state.request("n", False, 0.0, "t")
    assert isinstance(held, Lease) and held.provider == A
    assert isinstance(waiting, Waiter)  # B is free: the tenant's cap holds it
    return state, held, waiting


def _grants(decisions: list[object]) -> list[tuple[Waiter, ProviderKey]]:
    return [(d.waiter, d.lease.provider) for d in decisions if isinstance(d, Granted)]


@pytest.mark.req("tenant-quotas")
def test_disconnect_fencing_a_tenants_lease_grants_its_waiter_elsewhere() -> None:
    state, held, waiting = _held_and_waiting()
    ok, decisions = state.disconnect("node-a", state.generation("node-a"))
    assert ok and held.revoked
    assert _grants(decisions) == [(waiting, B)]


@pytest.mark.req("tenant-quotas")
def test_release_on_a_removed_provider_grants_the_tenants_waiter_elsewhere() -> None:
    state, held, waiting = _held_and_waiting()
    assert _grants(state.refresh(_config(with_a=False))) == []
    assert _grants(state.release(held)) == [(waiting, B)]


def _one_slot(tenants: tuple[TenantSpec, ...]) -> PoolConfig:
    providers = {A: ProviderSpec(capacity=1, long_context_capacity=0)}
    return PoolConfig(
        policy=QueuePolicy(queue_timeout=1e9),
        providers=providers,
        models={"m": ModelGroup(candidates=(A,))},
        tenants=tenants,
    )


@pytest.mark.req("tenant-quotas")
def test_tenants_configured_while_waiters_queue_give_them_tickets() -> None:
    """Waiters queued before any tenant was configured are the default tenant's; a refresh that
    configures tenants gives them tickets in arrival order (``max_queue`` does not refuse what
    was admitted already), and a later arrival of tenant a shares with them fairly: second,
    not last."""
    state = AdmissionState(_one_slot(()))
    state.connect("node-a")
    held = state.request("m", False, 0.0)
    assert isinstance(held, Lease)
    queued = [state.request("m", False, 0.0) for _ in range(3)]
    tenants = (TenantSpec("default", max_queue=1), TenantSpec("a"))
    assert state.refresh(_one_slot(tenants)) == []
    later = state.request("m", False, 0.0, "a")
    assert all(isinstance(w, Waiter) for w in (*queued, later))
    order = []
    lease = held
    for _ in range(4):
        [(waiter, _provider)] = _grants(state.release(lease))
        order.append(waiter)
        assert waiter.lease is not None
        lease = waiter.lease
    assert order == [queued[0], later, queued[1], queued[2]]

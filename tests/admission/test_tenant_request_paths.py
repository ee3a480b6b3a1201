"""A request with tenants configured: its refusals and its waiter's times.

Sans-I/O example tests of what the mutation run (docs/reliability.md) found unchecked on
the tenant path of ``request``: the ``Unavailable`` of a request no candidate can run
names its model, kind and each candidate's reason; a full queue with nothing to shed
names the model asked for; a tenant's waiter counts its deadline from its arrival,
and a refresh moves it from there.
"""

from __future__ import annotations

import pytest

from iop_admission import (
    ModelGroup,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    QueueFull,
    QueuePolicy,
    TenantSpec,
    Unavailable,
)
from iop_admission.core import AdmissionState, Lease, Waiter

A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-b", "gpu1")
TENANTS = (TenantSpec("t"), TenantSpec("low", priority=-1))


def _config(timeout: float = 5.0, max_queue: int = 10) -> PoolConfig:
    return PoolConfig(
        policy=QueuePolicy(queue_timeout=timeout, max_queue=max_queue),
        providers={
            A: ProviderSpec(capacity=1, long_context_capacity=0),
            B: ProviderSpec(capacity=1, long_context_capacity=1),
        },
        models={"m": ModelGroup(candidates=(A, B)), "n": ModelGroup(candidates=(A,))},
        tenants=TENANTS,
    )


@pytest.mark.req("tenant-fair-share")
def test_unavailable_long_request_of_a_tenant_names_model_kind_and_reasons() -> None:
    state = AdmissionState(_config())
    state.connect("node-a")  # node-b stays offline: no candidate can run a long request
    with pytest.raises(Unavailable) as caught:
        state.request("m", True, 0.0, "t")
    err = caught.value
    assert (err.model, err.long) == ("m", True)
    assert err.reasons == (
        "node-a/gpu0: runs no long requests (long_context_capacity=0)",
        "node-b/gpu1: node 'node-b' is not connected (call connect('node-b'))",
    )
    assert str(err).startswith("no eligible provider for long request on model 'm'; node-a/gpu0: runs no long")


@pytest.mark.req("tenant-quotas")
def test_full_queue_with_nothing_to_shed_names_the_model_asked_for() -> None:
    state = AdmissionState(_config(max_queue=1))
    state.connect("node-a")
    assert isinstance(state.request("n", False, 0.0, "t"), Lease)
    assert isinstance(state.request("n", False, 0.0, "t"), Waiter)
    with pytest.raises(QueueFull) as caught:
        state.request("m", False, 0.0, "t")
    assert (caught.value.model, caught.value.max_queue) == ("m", 1)


@pytest.mark.req("tenant-fair-share")
def test_tenant_waiter_deadline_counts_from_its_arrival() -> None:
    """Queued at 2 with a timeout of 5, a tenant's waiter is in time at 6.9 and expires at 7;
    a refresh to a timeout of 10 moves its deadline to 12 (its arrival time kept)."""
    state = AdmissionState(_config())
    state.connect("node-a")
    assert isinstance(state.request("n", False, 0.0, "t"), Lease)
    first = state.request("n", False, 2.0, "t")
    second = state.request("n", False, 3.0, "low")
    assert isinstance(first, Waiter) and isinstance(second, Waiter)
    assert (first.enqueue_time, first.deadline) == (2.0, 7.0)
    assert state.expire(6.9) == []
    assert state.expire(7.0) == [first]
    state.refresh(_config(timeout=10.0))
    assert (second.enqueue_time, second.deadline) == (3.0, 13.0)
    assert state.expire(12.9) == []
    assert state.expire(13.0) == [second]


@pytest.mark.req("tenant-token-cost")
def test_settling_a_lease_granted_before_tenants_only_records_its_cost() -> None:
    """A lease granted before a refresh configured tenants has no ticket: settling it records
    the cost it used and charges nobody."""
    untenanted = _config()
    state = AdmissionState(
        PoolConfig(policy=untenanted.policy, providers=untenanted.providers, models=untenanted.models)
    )
    state.connect("node-a")
    lease = state.request("n", False, 0.0)
    assert isinstance(lease, Lease)
    state.refresh(_config())
    state.settle(lease, 5.0)
    assert lease.cost == 5.0
    assert [row.cost_charged for row in state.tenant_snapshots()] == [0.0, 0.0, 0.0]


@pytest.mark.req("tenant-quotas")
def test_disconnect_fences_a_lease_granted_before_tenants() -> None:
    """A node's disconnect fences a lease granted before tenants were configured (it has no
    ticket): it is revoked, no tenant is charged a release, and the queue goes on."""
    untenanted = _config()
    state = AdmissionState(
        PoolConfig(policy=untenanted.policy, providers=untenanted.providers, models=untenanted.models)
    )
    state.connect("node-a")
    lease = state.request("n", False, 0.0)
    assert isinstance(lease, Lease)
    state.refresh(_config())
    ok, _decisions = state.disconnect("node-a", state.generation("node-a"))
    assert ok and lease.revoked
    assert [(row.in_flight, row.waiting) for row in state.tenant_snapshots()] == [(0, 0)] * 3

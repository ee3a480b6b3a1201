"""The tenant rows of a snapshot and the answer of a live tenant reconfiguration.

Example tests of figures the mutation run (docs/reliability.md) found unchecked: every
field of a tenant row (its spec, counts and share), the window of recent grants the
share is measured over, and whether a prepared refresh that changes only the tenants
dispatches the waiters it may have freed.
"""

from __future__ import annotations

import pytest

from iop_admission import ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy, TenantSnapshot, TenantSpec
from iop_admission.core import RECENT_GRANTS, AdmissionState, Granted, Lease, Tenancy, Waiter

A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-b", "gpu1")


def _config(tenants: tuple[TenantSpec, ...], capacity: int = 4) -> PoolConfig:
    return PoolConfig(
        policy=QueuePolicy(queue_timeout=1e9),
        providers={
            A: ProviderSpec(capacity=capacity, long_context_capacity=0),
            B: ProviderSpec(capacity=capacity, long_context_capacity=0),
        },
        models={"m": ModelGroup(candidates=(A,)), "n": ModelGroup(candidates=(B,))},
        tenants=tenants,
    )


def _state(config: PoolConfig) -> AdmissionState:
    state = AdmissionState(config)
    for node in state.nodes():
        state.connect(node)
    return state


@pytest.mark.req("tenant-fair-share")
def test_tenant_rows_show_each_spec_and_share_of_grants() -> None:
    """Rows in config order, then ``default``: each tenant's spec as configured, its waiters,
    leases, grants, share of the recent grants and cost charged; before any grant every share is 0."""
    tenants = (
        TenantSpec("gold", weight=3.0, priority=2, max_in_flight=5, max_queue=7),
        TenantSpec("bronze", weight=0.5, priority=-1, max_in_flight=1, max_queue=2),
    )
    state = _state(_config(tenants, capacity=2))
    assert [(r.name, r.share, r.grants) for r in state.tenant_snapshots()] == [
        ("gold", 0.0, 0),
        ("bronze", 0.0, 0),
        ("default", 0.0, 0),
    ]
    gold = [state.request("m", False, 0.0, "gold", cost=2.5) for _ in range(3)]
    bronze = [state.request("n", False, 0.0, "bronze") for _ in range(2)]
    other = state.request("n", False, 0.0, "nobody")
    assert [type(x) for x in (*gold, *bronze, other)] == [Lease, Lease, Waiter, Lease, Waiter, Lease]
    assert state.tenant_snapshots() == (
        TenantSnapshot("gold", 3.0, 2, 5, 7, waiting=1, in_flight=2, grants=2, share=0.5, cost_charged=5.0),
        TenantSnapshot("bronze", 0.5, -1, 1, 2, waiting=1, in_flight=1, grants=1, share=0.25, cost_charged=1.0),
        TenantSnapshot("default", 1.0, 0, None, None, waiting=0, in_flight=1, grants=1, share=0.25, cost_charged=1.0),
    )


def test_share_is_measured_over_the_latest_grants_only() -> None:
    """The share window holds the latest RECENT_GRANTS grants: the oldest one leaves it when
    one more comes, and its tenant's count with it."""
    tenancy = Tenancy((TenantSpec("a"), TenantSpec("b")))
    tenancy.note_grant("b")
    for _ in range(RECENT_GRANTS - 1):
        tenancy.note_grant("a")
    shares = {row.name: row.share for row in tenancy.rows()}
    assert shares == {"a": (RECENT_GRANTS - 1) / RECENT_GRANTS, "b": 1 / RECENT_GRANTS, "default": 0.0}
    tenancy.note_grant("a")  # b's grant leaves the window
    shares = {row.name: row.share for row in tenancy.rows()}
    assert shares == {"a": 1.0, "b": 0.0, "default": 0.0}


@pytest.mark.req("tenant-quotas")
def test_prepared_refresh_raising_a_cap_grants_the_tenants_waiters() -> None:
    """A prepared refresh that changes only a tenant's ``max_in_flight`` touches no provider or
    group, yet the waiters its cap held are granted at once, in every group."""
    before = _config((TenantSpec("t", max_in_flight=1),))
    state = _state(before)
    held = state.request("m", False, 0.0, "t")
    waiting = [state.request("m", False, 0.0, "t"), state.request("n", False, 0.0, "t")]
    assert isinstance(held, Lease) and all(isinstance(w, Waiter) for w in waiting)
    after = _config((TenantSpec("t", max_in_flight=3),))
    decisions = state.refresh(state.prepare_refresh(after))
    assert [(d.waiter, d.lease.provider) for d in decisions if isinstance(d, Granted)] == [
        (waiting[0], A),
        (waiting[1], B),
    ]


@pytest.mark.req("tenant-quotas")
def test_prepared_refresh_with_the_same_tenants_keeps_their_counts() -> None:
    """Tenants configured again unchanged keep their rows as they were."""
    before = _config((TenantSpec("t", max_in_flight=1),))
    state = _state(before)
    state.request("m", False, 0.0, "t")
    rows = state.tenant_snapshots()
    assert state.refresh(state.prepare_refresh(_config((TenantSpec("t", max_in_flight=1),)))) == []
    assert state.tenant_snapshots() == rows

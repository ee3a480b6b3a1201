"""The core's decisions with tenants configured: shedding a waiter for a full queue, and the
candidate a fair dispatch gives a queued long waiter or a queued long retry.

Sans-I/O tests with exact steps: the errors a full queue raises or puts on the shed waiter
(their tenant, limit, value, model), the state a shed or granted waiter is left in, and a long
waiter granted a long slot, not the better provider whose long slots are all taken.
"""

from __future__ import annotations

import pytest
from tests.admission.steps import as_lease as _lease
from tests.admission.steps import as_waiter as _waiter

from iop_admission import (
    ModelGroup,
    ModelNotFound,
    OutlierPolicy,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    QueueFull,
    QueuePolicy,
    TenantLimitExceeded,
    TenantSpec,
)
from iop_admission.core import AdmissionState, Ejected, Failed, Granted, Lease, WaiterState

A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-b", "gpu1")
C = ProviderKey("node-c", "gpu2")
M = "m"


def _state(config: PoolConfig) -> AdmissionState:
    state = AdmissionState(config)
    for node in state.nodes():
        state.connect(node)
    return state


def _one_slot_two_bands() -> AdmissionState:
    """One provider of one slot; ``max_queue`` 1; tenant ``high`` of band 0, ``low`` of band -1."""
    return _state(
        PoolConfig(
            policy=QueuePolicy(max_queue=1, queue_timeout=60.0),
            providers={A: ProviderSpec(capacity=1, long_context_capacity=0)},
            models={M: ModelGroup(candidates=(A,))},
            tenants=(TenantSpec("high"), TenantSpec("low", priority=-1)),
        )
    )


@pytest.mark.req("tenant-quotas")
def test_full_queue_sheds_the_lower_band_waiter_with_its_own_error() -> None:
    state = _one_slot_two_bands()
    _lease(state.request(M, False, 0.0, "high"))
    shed = _waiter(state.request(M, False, 0.0, "low"))
    newcomer = _waiter(state.request(M, False, 1.0, "high"))
    assert shed.state is WaiterState.FAILED
    error = shed.error
    assert isinstance(error, TenantLimitExceeded)
    assert (error.tenant, error.limit, error.value) == ("low", "shed", 1)
    [decision] = state.drain_decisions()
    assert isinstance(decision, Failed) and decision.waiter is shed and decision.error is error
    assert list(state.waiters()) == [newcomer]


@pytest.mark.req("tenant-quotas")
def test_full_queue_refuses_a_lower_band_request_with_nothing_lower_to_shed() -> None:
    state = _one_slot_two_bands()
    _lease(state.request(M, False, 0.0, "high"))
    queued = _waiter(state.request(M, False, 0.0, "high"))
    with pytest.raises(TenantLimitExceeded) as refused:
        state.request(M, False, 1.0, "low")
    assert (refused.value.tenant, refused.value.limit, refused.value.value) == ("low", "shed", 1)
    with pytest.raises(QueueFull) as full:
        state.request(M, False, 1.0, "high")
    assert (full.value.model, full.value.max_queue) == (M, 1)
    assert list(state.waiters()) == [queued] and state.drain_decisions() == []


def _long_slots(*specs: ProviderSpec) -> AdmissionState:
    keys = (A, B, C)[: len(specs)]
    return _state(
        PoolConfig(
            policy=QueuePolicy(queue_timeout=60.0),
            providers=dict(zip(keys, specs, strict=True)),
            models={M: ModelGroup(candidates=keys)},
            tenants=(TenantSpec("t"),),
        )
    )


@pytest.mark.req("tenant-fair-share", "long-state")
def test_fair_dispatch_gives_a_long_waiter_the_provider_with_a_free_long_slot() -> None:
    """gpu0 is preferred and has normal room but its one long slot is taken: the long waiter
    granted when gpu1's long lease ends goes to gpu1, in state GRANTED."""
    state = _long_slots(
        ProviderSpec(capacity=3, long_context_capacity=1, priority=1),
        ProviderSpec(capacity=1, long_context_capacity=1),
    )
    on_a = _lease(state.request(M, True, 0.0, "t"))
    on_b = _lease(state.request(M, True, 0.0, "t"))
    assert (on_a.provider, on_b.provider) == (A, B)
    waiting = _waiter(state.request(M, True, 1.0, "t"))
    [grant] = state.release(on_b)
    assert isinstance(grant, Granted) and grant.waiter is waiting
    assert (grant.lease.provider, grant.lease.long) == (B, True)
    assert waiting.state is WaiterState.GRANTED and waiting.lease is grant.lease


@pytest.mark.req("tenant-fair-share", "failover-before-first-byte")
def test_fair_dispatch_gives_a_queued_long_retry_an_untried_provider_with_a_free_long_slot() -> None:
    """The long retry of gpu0's lease waits (gpu1 and gpu2 have no long slot free); when gpu2's
    long lease ends it goes to gpu2, not to gpu1, preferred and with normal room only."""
    state = _long_slots(
        ProviderSpec(capacity=1, long_context_capacity=1, priority=2),
        ProviderSpec(capacity=3, long_context_capacity=1, priority=1),
        ProviderSpec(capacity=1, long_context_capacity=1),
    )
    first, on_b, on_c = (_lease(state.request(M, True, 0.0, "t")) for _ in range(3))
    assert (first.provider, on_b.provider, on_c.provider) == (A, B, C)
    retried = _waiter(state.retry(first, 1.0))
    assert state.release(first) == []
    [grant] = state.release(on_c)
    assert isinstance(grant, Granted) and grant.waiter is retried
    assert (grant.lease.provider, grant.lease.long, grant.lease.tried) == (C, True, (A, C))
    assert retried.state is WaiterState.GRANTED


def _ejected_long_slot() -> tuple[AdmissionState, Lease]:
    """m on gpu0 (preferred, one slot, no long slot) and gpu1 (one slot, one long slot); gpu1's
    failure ejects it, so long requests of m are in panic mode on gpu1; gpu0 runs a normal lease."""
    state = _state(
        PoolConfig(
            policy=QueuePolicy(queue_timeout=60.0),
            providers={
                A: ProviderSpec(capacity=1, long_context_capacity=0, priority=1),
                B: ProviderSpec(capacity=1, long_context_capacity=1),
            },
            models={M: ModelGroup(candidates=(A, B))},
            outlier=OutlierPolicy(1, 10.0, 20.0),
            tenants=(TenantSpec("t"),),
        )
    )
    failed = _lease(state.request(M, True, 0.0, "t"))
    assert failed.provider == B
    state.release(failed)
    assert any(isinstance(d, Ejected) for d in state.report_failure(failed, 0.0))
    assert _lease(state.request(M, False, 0.0, "t")).provider == A
    return state, _lease(state.request(M, True, 0.0, "t"))


@pytest.mark.req("tenant-fair-share", "outlier-ejection")
def test_fair_dispatch_grants_a_long_waiter_in_panic_mode_while_the_admitting_provider_is_full() -> None:
    """The long waiter's only long candidate, gpu1, is ejected (panic mode); gpu0 admits but is
    full and runs no long request. gpu1's panic lease ends: the waiter gets gpu1."""
    state, panic_lease = _ejected_long_slot()
    assert panic_lease.provider == B and state.panic_models() == ()
    waiting = _waiter(state.request(M, True, 0.0, "t"))
    [grant] = state.release(panic_lease)
    assert isinstance(grant, Granted) and grant.waiter is waiting
    assert (grant.lease.provider, grant.lease.long, grant.lease.probe) == (B, True, False)


@pytest.mark.req("tenant-fair-share", "outlier-ejection", "failover-before-first-byte")
def test_fair_dispatch_grants_a_queued_long_retry_in_panic_mode_while_the_admitting_provider_is_full() -> None:
    """As above for a queued long retry: the retry of a lease on gpu2 (preferred, tried) has gpu0
    (admitting, full, no long slot) and gpu1 (ejected) left, and gets gpu1 when it frees."""
    state = _state(
        PoolConfig(
            policy=QueuePolicy(queue_timeout=60.0),
            providers={
                C: ProviderSpec(capacity=1, long_context_capacity=1, priority=2),
                A: ProviderSpec(capacity=1, long_context_capacity=0, priority=1),
                B: ProviderSpec(capacity=1, long_context_capacity=1),
            },
            models={M: ModelGroup(candidates=(C, A, B)), "b": ModelGroup(candidates=(B,))},
            outlier=OutlierPolicy(1, 10.0, 20.0),
            tenants=(TenantSpec("t"),),
        )
    )
    failed = _lease(state.request("b", False, 0.0, "t"))
    state.release(failed)
    assert any(isinstance(d, Ejected) for d in state.report_failure(failed, 0.0))
    panic_lease = _lease(state.request("b", False, 0.0, "t"))  # b's only candidate is ejected
    first = _lease(state.request(M, True, 0.0, "t"))
    assert (panic_lease.provider, first.provider) == (B, C)
    assert _lease(state.request(M, False, 0.0, "t")).provider == A
    retried = _waiter(state.retry(first, 1.0))
    [grant] = state.release(panic_lease)
    assert isinstance(grant, Granted) and grant.waiter is retried
    assert (grant.lease.provider, grant.lease.long, grant.lease.tried) == (B, True, (C, B))


@pytest.mark.req("tenant-quotas", "refresh-consistency")
def test_waiter_failed_by_a_refresh_leaves_its_tenants_queue() -> None:
    """Tenant t may queue one waiter; a refresh that drops its model fails it (ModelNotFound),
    and t may queue again at once."""
    tenants = (TenantSpec("t", max_queue=1),)
    providers = {A: ProviderSpec(capacity=1, long_context_capacity=0)}
    config = PoolConfig(
        policy=QueuePolicy(queue_timeout=60.0),
        providers=providers,
        models={M: ModelGroup(candidates=(A,)), "gone": ModelGroup(candidates=(A,))},
        tenants=tenants,
    )
    state = _state(config)
    _lease(state.request(M, False, 0.0, "t"))
    dropped = _waiter(state.request("gone", False, 0.0, "t"))
    with pytest.raises(TenantLimitExceeded):
        state.request(M, False, 0.0, "t")
    [failed] = state.refresh(
        PoolConfig(policy=config.policy, providers=providers, models={M: ModelGroup(candidates=(A,))}, tenants=tenants)
    )
    assert isinstance(failed, Failed) and failed.waiter is dropped and isinstance(failed.error, ModelNotFound)
    again = _waiter(state.request(M, False, 1.0, "t"))
    assert list(state.waiters()) == [again]


@pytest.mark.req("tenant-quotas")
def test_reconnect_fencing_a_tenants_lease_grants_its_waiter_on_another_node() -> None:
    """Tenant t may hold one lease: its waiter for n (gpu1, free) waits for t's slot. node-a
    connecting again fences t's lease on gpu0: the waiter gets gpu1 in the same call."""
    state = _state(
        PoolConfig(
            policy=QueuePolicy(queue_timeout=60.0),
            providers={
                A: ProviderSpec(capacity=1, long_context_capacity=0),
                B: ProviderSpec(capacity=1, long_context_capacity=0),
            },
            models={M: ModelGroup(candidates=(A,)), "n": ModelGroup(candidates=(B,))},
            tenants=(TenantSpec("t", max_in_flight=1),),
        )
    )
    held = _lease(state.request(M, False, 0.0, "t"))
    waiting = _waiter(state.request("n", False, 0.0, "t"))
    _, decisions = state.connect("node-a")
    assert held.revoked
    grants = [(d.waiter, d.lease.provider) for d in decisions if isinstance(d, Granted)]
    assert grants == [(waiting, B)]

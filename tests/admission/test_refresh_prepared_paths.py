"""A prepared refresh (only what changed is touched) on the paths it shares with a direct one.

Sans-I/O tests with exact steps, each run through both kinds of refresh where both apply:
a model group rebuilt with other candidates grants its waiter a candidate that was free
already, and still grants its queued retry later; a provider removed while a lease runs on it
takes no count held elsewhere and forgets the one it had (its long one too, when it comes back
before the lease ends); a refresh that only raises a
tenant's cap grants that tenant's waiter.
"""

from __future__ import annotations

import pytest
from tests.admission.steps import as_lease as _lease
from tests.admission.steps import as_waiter as _waiter

from iop_admission import ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy, TenantSpec
from iop_admission.core import AdmissionState, Granted, Waiter, WaiterState

A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-b", "gpu1")
M = "m"
N = "n"


def _config(
    providers: dict[ProviderKey, ProviderSpec],
    models: dict[str, tuple[ProviderKey, ...]],
    tenants: tuple[TenantSpec, ...] = (),
) -> PoolConfig:
    return PoolConfig(
        policy=QueuePolicy(queue_timeout=60.0),
        providers=providers,
        models={name: ModelGroup(candidates=keys) for name, keys in models.items()},
        tenants=tenants,
    )


def _spec(capacity: int = 1, priority: int = 0, long_cap: int = 0) -> ProviderSpec:
    return ProviderSpec(capacity=capacity, long_context_capacity=long_cap, priority=priority)


def _state(config: PoolConfig) -> AdmissionState:
    state = AdmissionState(config)
    for node in state.nodes():
        state.connect(node)
    return state


def _refresh(state: AdmissionState, config: PoolConfig, prepared: bool) -> list[object]:
    return list(state.refresh(state.prepare_refresh(config) if prepared else config))


def _grants(decisions: list[object]) -> list[tuple[Waiter, ProviderKey]]:
    return [(d.waiter, d.lease.provider) for d in decisions if isinstance(d, Granted)]


@pytest.mark.req("refresh-consistency")
@pytest.mark.parametrize("prepared", [False, True])
def test_refresh_giving_a_model_a_free_candidate_grants_its_waiter(prepared: bool) -> None:
    """m waits for gpu0; the refresh adds gpu1 (unchanged, free, serving n) to m's candidates."""
    providers = {A: _spec(), B: _spec()}
    state = _state(_config(providers, {M: (A,), N: (B,)}))
    _lease(state.request(M, False, 0.0))
    waiting = _waiter(state.request(M, False, 0.0))
    assert _grants(_refresh(state, _config(providers, {M: (A, B), N: (B,)}), prepared)) == [(waiting, B)]


@pytest.mark.req("refresh-consistency", "failover-before-first-byte")
@pytest.mark.parametrize("prepared", [False, True])
def test_queued_retry_of_a_model_whose_candidates_changed_is_granted_when_one_frees(prepared: bool) -> None:
    """The retry of gpu0's lease waits for gpu1; a refresh reorders m's candidates (the group is
    built anew); gpu1's release grants the retry."""
    providers = {A: _spec(priority=1), B: _spec()}
    state = _state(_config(providers, {M: (A, B)}))
    first = _lease(state.request(M, False, 0.0))
    on_b = _lease(state.request(M, False, 0.0))
    retried = _waiter(state.retry(first, 1.0))
    assert _grants(_refresh(state, _config(providers, {M: (B, A)}), prepared)) == []
    assert _grants(state.release(on_b)) == [(retried, B)]
    assert retried.state is WaiterState.GRANTED


def _snapshot_of(state: AdmissionState, key: ProviderKey) -> tuple[int, bool]:
    [row] = [(p.in_flight, p.connected) for p in state.provider_snapshots() if p.provider_id == key.provider_id]
    return row


@pytest.mark.req("held-elsewhere", "refresh-consistency")
@pytest.mark.parametrize("prepared", [False, True])
def test_provider_removed_with_a_live_lease_takes_no_held_count(prepared: bool) -> None:
    """gpu0, removed while a lease runs on it, is not configured: ``hold`` leaves it as it is,
    so when it comes back (its lease ended) it runs nothing and is granted at once."""
    both = {A: _spec(), B: _spec()}
    state = _state(_config(both, {M: (A, B)}))
    running = _lease(state.request(M, False, 0.0))
    assert running.provider == A
    _refresh(state, _config({B: _spec()}, {M: (B,)}), prepared)
    assert state.hold(A, 1) == []
    assert state.release(running) == []
    _refresh(state, _config(both, {M: (A, B)}), prepared)
    assert _snapshot_of(state, A) == (0, True)
    assert _lease(state.request(M, False, 1.0)).provider == A


@pytest.mark.req("held-elsewhere", "refresh-consistency")
@pytest.mark.parametrize("prepared", [False, True])
def test_provider_removed_forgets_its_held_runs_and_comes_back_with_its_leases_only(prepared: bool) -> None:
    """gpu0 holds 2 runs elsewhere and runs a lease; removed, it forgets the 2; back in the config
    before the lease ends, it counts that lease alone, and a new count of 1 is added to it."""
    both = {A: _spec(capacity=4), B: _spec()}
    state = _state(_config(both, {M: (A, B)}))
    running = _lease(state.request(M, False, 0.0))
    assert state.hold(A, 2) == []
    assert _snapshot_of(state, A) == (3, True)
    _refresh(state, _config({B: _spec()}, {M: (B,)}), prepared)
    _refresh(state, _config(both, {M: (A, B)}), prepared)
    assert _snapshot_of(state, A) == (1, True)
    assert state.hold(A, 1) == []
    assert _snapshot_of(state, A) == (2, True)
    state.release(running)
    assert _snapshot_of(state, A) == (1, True)


@pytest.mark.req("held-elsewhere", "refresh-consistency")
@pytest.mark.parametrize("prepared", [False, True])
def test_provider_removed_and_re_added_keeps_no_phantom_held_long_run(prepared: bool) -> None:
    """gpu0 holds a long run elsewhere and runs a lease; removed and re-added before the lease ends,
    it forgets the held run and its long slot: once the lease ends a long request takes the slot."""
    both = {A: _spec(capacity=3, long_cap=1), B: _spec()}
    state = _state(_config(both, {M: (A, B)}))
    running = _lease(state.request(M, False, 0.0))
    assert state.hold(A, 1, 1) == []
    _refresh(state, _config({B: _spec()}, {M: (B,)}), prepared)
    _refresh(state, _config(both, {M: (A, B)}), prepared)
    assert state.hold(A, 1) == []  # a new count, of no long run
    assert state.release(running) == []
    (row,) = (r for r in state.provider_snapshots() if r.provider_id == A.provider_id)
    assert (row.in_flight, row.long_in_flight) == (1, 0)
    long = _lease(state.request(M, True, 1.0))
    assert long.provider == A
    assert state.release(long) == []
    assert state.hold(A, 0) == []


@pytest.mark.req("tenant-quotas", "refresh-consistency")
@pytest.mark.parametrize("prepared", [False, True])
def test_refresh_raising_a_tenants_cap_grants_its_waiter(prepared: bool) -> None:
    """Tenant t may hold one lease; gpu0 has room for two. A refresh that changes only t's
    ``max_in_flight`` (no provider, no model group) grants t's waiter at once."""
    providers = {A: _spec(capacity=2)}
    state = _state(_config(providers, {M: (A,)}, (TenantSpec("t", max_in_flight=1),)))
    _lease(state.request(M, False, 0.0, "t"))
    waiting = _waiter(state.request(M, False, 0.0, "t"))
    raised = _config(providers, {M: (A,)}, (TenantSpec("t", max_in_flight=2),))
    assert _grants(_refresh(state, raised, prepared)) == [(waiting, A)]

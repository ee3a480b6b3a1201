"""[outlier-ejection] A grant that starts a probe stops its provider admitting. When that leaves every
candidate of a queued request ejected or probing, the request is in panic mode, and it is granted at
once. The state machine found such a waiter stranded: nothing re-examined the probed provider's
groups after a probe granted at once to a new request (the first test fails without the fix). A
probe granted to a waiter is followed by a dispatch of the probed provider's groups too (the second
test pins that path, where the release's own dispatch already covered the groups here)."""

from __future__ import annotations

import pytest

from iop_admission import ModelGroup, OutlierPolicy, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy, TenantSpec
from iop_admission.core import AdmissionState, Granted, Lease, Waiter

A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-b", "gpu0")


def _state(capacity: int = 2, tenants: tuple[TenantSpec, ...] = ()) -> AdmissionState:
    state = AdmissionState(
        PoolConfig(
            policy=QueuePolicy(max_queue=10, queue_timeout=60.0),
            providers={k: ProviderSpec(capacity=capacity, long_context_capacity=1) for k in (A, B)},
            models={"m": ModelGroup((A, B)), "a": ModelGroup((A,)), "b": ModelGroup((B,))},
            outlier=OutlierPolicy(consecutive_failures=1, base_ejection=1.0, max_ejection=1.0),
            tenants=tenants,
        )
    )
    state.connect("node-a")
    state.connect("node-b")
    return state


def _lease(result: Lease | Waiter) -> Lease:
    assert type(result) is Lease, result
    return result


def _eject(state: AdmissionState, model: str) -> None:
    lease = _lease(state.request(model, False, 0.0))
    state.report_failure(lease, 0.0)
    assert state.release(lease) == []


@pytest.mark.req("outlier-ejection", "tenant-fair-share")
@pytest.mark.parametrize("tenants", [(), (TenantSpec("t"), TenantSpec("u", weight=2.0))], ids=["untenanted", "tenants"])
def test_a_probe_granted_to_a_new_request_grants_the_waiters_it_puts_in_panic_mode(
    tenants: tuple[TenantSpec, ...],
) -> None:
    """With tenants too: a tenant's request that takes the last probe goes through the fair path."""
    state = _state(tenants=tenants)
    b_long = _lease(state.request("b", True, 0.0))  # B's long slot is taken throughout
    _eject(state, "a")
    _eject(state, "b")
    assert state.advance(1.0) == []  # both ejections end: each admits its one probe
    a_probe = _lease(state.request("a", False, 1.0))
    assert a_probe.probe and a_probe.provider == A
    # A probes (admits nothing), B admits its probe but has no long slot: a long request waits.
    waiter = state.request("m", True, 1.0)
    assert type(waiter) is Waiter
    assert state.drain_decisions() == []
    # B's probe goes to a new request: now neither candidate admits, and the waiter is in
    # panic mode, where A has room for it.
    b_probe = _lease(state.request("m", False, 1.0, "u"))
    assert b_probe.probe and b_probe.provider == B
    (granted,) = state.drain_decisions()
    assert isinstance(granted, Granted)
    assert granted.waiter is waiter and granted.lease.provider == A and granted.lease.long
    assert state.queue_depth == 0
    for lease in (a_probe, b_probe, b_long, granted.lease):
        state.release(lease)
    assert not list(state.live_leases())


@pytest.mark.req("outlier-ejection")
def test_a_probe_granted_to_a_waiter_grants_the_waiters_it_puts_in_panic_mode() -> None:
    state = _state()
    b_long = _lease(state.request("b", True, 0.0))
    b_other = _lease(state.request("b", False, 0.0))  # B full (2 of 2), its long slot taken
    state.report_failure(b_other, 0.0)  # B ejected; the lease runs on
    _eject(state, "a")
    assert state.advance(1.0) == []
    a_probe = _lease(state.request("a", False, 1.0))
    assert a_probe.probe
    b_waiter = state.request("b", False, 1.0)  # B admits its probe but is full: waits
    long_waiter = state.request("m", True, 1.0)  # A probes, B admits but has no long slot: waits
    assert type(b_waiter) is Waiter and type(long_waiter) is Waiter
    # B's lease ends: its probe goes to the earlier waiter, which puts the long one in panic mode.
    first, second = state.release(b_other)
    assert isinstance(first, Granted) and isinstance(second, Granted)
    assert first.waiter is b_waiter and first.lease.probe and first.lease.provider == B
    assert second.waiter is long_waiter and second.lease.provider == A and second.lease.long
    assert state.queue_depth == 0
    for lease in (a_probe, b_long, first.lease, second.lease):
        state.release(lease)
    assert not list(state.live_leases())


@pytest.mark.req("outlier-ejection", "failover-before-first-byte")
def test_a_probe_granted_to_a_retry_grants_the_waiters_it_puts_in_panic_mode() -> None:
    """A retry whose grant starts the last admitting candidate's probe leaves the waiter it puts in
    panic mode granted in ``drain_decisions()`` (the path of a new request, through ``retry``)."""
    state = _state(capacity=3)
    first = _lease(state.request("m", False, 0.0))  # the attempt that will fail over, on A
    assert first.provider == A
    b_long = _lease(state.request("b", True, 0.0))  # B's long slot is taken throughout
    _eject(state, "a")
    _eject(state, "b")
    assert state.advance(1.0) == []
    a_probe = _lease(state.request("a", False, 1.0))
    assert a_probe.probe
    waiter = state.request("m", True, 1.0)  # A probes, B admits but has no long slot: waits
    assert type(waiter) is Waiter
    assert state.release(first) == []  # A still probes: nothing for the long waiter
    again = _lease(state.retry(first, 1.0))  # B untried: its probe goes to the retry
    assert again.probe and again.provider == B and again.attempt == 2
    (granted,) = state.drain_decisions()
    assert isinstance(granted, Granted)
    assert granted.waiter is waiter and granted.lease.provider == A and granted.lease.long
    assert state.queue_depth == 0
    for lease in (a_probe, b_long, again, granted.lease):
        state.release(lease)
    assert not list(state.live_leases())


def test_a_probe_released_without_a_report_takes_its_lone_model_key_out_of_panic() -> None:
    """A provider that runs its model key alone is ejected, its probe granted and released with
    no report: the provider admits again (the next grant probes), so the key is not in panic."""
    state = AdmissionState(
        PoolConfig(
            policy=QueuePolicy(max_queue=10, queue_timeout=60.0),
            providers={A: ProviderSpec(capacity=2)},
            models={"a": ModelGroup((A,))},
            outlier=OutlierPolicy(consecutive_failures=1, base_ejection=1.0, max_ejection=1.0),
        )
    )
    state.connect("node-a")
    failed = _lease(state.request("a", False, 0.0))
    state.release(failed)
    state.report_failure(failed, 0.0)
    assert state.panic_models() == ("a",)
    state.advance(1.0)
    probe = _lease(state.request("a", False, 1.0))
    assert probe.probe and state.panic_models() == ("a",)
    state.release(probe)
    assert state.panic_models() == ()
    assert _lease(state.request("a", False, 1.0)).probe

"""A queued retry competes with the waiters of its groups by arrival number, both ways.

Sans-I/O tests with exact steps: a waiter that arrived before a request now queued as a retry
is granted first when the provider both can use frees; the retry gets the next one.
"""

from __future__ import annotations

import pytest
from tests.admission.steps import as_lease as _lease
from tests.admission.steps import as_waiter as _waiter

from iop_admission import ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy
from iop_admission.core import AdmissionState, Granted, WaiterState

A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-b", "gpu1")


@pytest.mark.req("failover-before-first-byte")
def test_earlier_waiter_is_granted_before_a_later_queued_retry() -> None:
    """fast (gpu0 only) queues at arrival 2; big's request, arrival 3, runs on gpu1, fails and
    queues as a retry for gpu0. gpu0 frees: arrival 2 first, then the retry."""
    state = AdmissionState(
        PoolConfig(
            policy=QueuePolicy(queue_timeout=60.0),
            providers={
                A: ProviderSpec(capacity=1, long_context_capacity=0),
                B: ProviderSpec(capacity=1, long_context_capacity=0, priority=-1),
            },
            models={"big": ModelGroup(candidates=(A, B)), "fast": ModelGroup(candidates=(A,))},
        )
    )
    for node in state.nodes():
        state.connect(node)
    first = _lease(state.request("fast", False, 0.0))
    waiting = _waiter(state.request("fast", False, 0.0))
    on_b = _lease(state.request("big", False, 0.0))
    assert on_b.provider == B and on_b.arrival > waiting.seq
    retried = _waiter(state.retry(on_b, 1.0))
    [to_waiter] = state.release(first)
    assert isinstance(to_waiter, Granted) and to_waiter.waiter is waiting and to_waiter.lease.provider == A
    assert retried.state is WaiterState.QUEUED
    [to_retry] = state.release(to_waiter.lease)
    assert isinstance(to_retry, Granted) and to_retry.waiter is retried
    assert (to_retry.lease.provider, to_retry.lease.tried) == (A, (B, A))

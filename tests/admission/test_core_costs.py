"""A request's reserved cost is its lease's, granted at once or after a wait (no tenants).

Sans-I/O tests: ``cost`` defaults to 1 per request; the cost asked is on the lease a request is
granted at once and on the lease a queued waiter is granted later.
"""

from __future__ import annotations

from iop_admission import ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy
from iop_admission.core import AdmissionState, Granted, Lease, Waiter

A = ProviderKey("node-a", "gpu0")
M = "m"


def _state() -> AdmissionState:
    state = AdmissionState(
        PoolConfig(
            policy=QueuePolicy(queue_timeout=60.0),
            providers={A: ProviderSpec(capacity=1, long_context_capacity=0)},
            models={M: ModelGroup(candidates=(A,))},
        )
    )
    state.connect("node-a")
    return state


def test_cost_defaults_to_one_per_request_and_is_the_leases() -> None:
    state = _state()
    plain = state.request(M, False, 0.0)
    assert isinstance(plain, Lease) and (plain.cost, plain.tenant) == (1.0, "default")
    state.release(plain)
    costly = state.request(M, False, 0.0, cost=250.0)
    assert isinstance(costly, Lease) and costly.cost == 250.0


def test_queued_waiters_cost_is_on_the_lease_it_is_granted() -> None:
    state = _state()
    held = state.request(M, False, 0.0)
    assert isinstance(held, Lease)
    waiting = state.request(M, False, 0.0, cost=40.0)
    assert isinstance(waiting, Waiter) and waiting.cost == 40.0
    [grant] = state.release(held)
    assert isinstance(grant, Granted) and grant.waiter is waiting
    assert (grant.lease.cost, grant.lease.tenant) == (40.0, "default")

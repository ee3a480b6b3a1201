"""A queued retry is a FairShare class of its own, whatever the model is called.

Waiters of one model key and kind share their candidates, so FairShare looks only at
the head of each class; a queued retry has candidates of its own (those it did not try)
and must never share a class with them. Its class key once was ``("retry", seq)``,
equal to ``(model, long)`` for a model called ``"retry"`` and a retry of arrival 1
(``1 == True``): the retry, unable to run, hid the long waiter behind it.
"""

from __future__ import annotations

import pytest

from iop_admission import ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy, TenantSpec
from iop_admission.core import AdmissionState, Granted, Lease, Waiter

A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-b", "gpu1")


@pytest.mark.req("tenant-fair-share")
@pytest.mark.parametrize("model", ["retry", "m"])
def test_queued_retry_does_not_hide_a_long_waiter_of_its_model(model: str) -> None:
    """The first request (arrival 1) holds A and is retried while B is busy: its retry queues
    for B only. When A frees, the long waiter of the model behind it is granted A."""
    spec = ProviderSpec(capacity=1, long_context_capacity=1)
    state = AdmissionState(
        PoolConfig(
            policy=QueuePolicy(queue_timeout=1e9),
            providers={A: spec, B: spec},
            models={model: ModelGroup(candidates=(A, B))},
            tenants=(TenantSpec("t"),),
        )
    )
    for node in state.nodes():
        state.connect(node)
    first = state.request(model, False, 0.0, "t")
    busy = state.request(model, True, 0.0, "t")
    waiter = state.request(model, True, 0.0, "t")
    assert isinstance(first, Lease) and isinstance(busy, Lease) and isinstance(waiter, Waiter)
    assert (first.arrival, first.provider, busy.provider) == (1, A, B)
    retry = state.retry(first, 0.0)
    assert isinstance(retry, Waiter) and retry.seq == 1
    decisions = state.release(first)
    assert [(d.waiter, d.lease.provider) for d in decisions if isinstance(d, Granted)] == [(waiter, A)]

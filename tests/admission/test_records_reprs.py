"""The core's records as a reader sees them: the reprs of leases, waiters and decisions, and the
fields a fresh lease or waiter starts with. A repr is what a log line or a failed assertion shows,
so each part of it is pinned exactly."""

from __future__ import annotations

import attrs
from tests.admission.steps import as_lease as _lease
from tests.admission.steps import as_waiter as _waiter

from iop_admission import OutlierPolicy, PoolConfig, ProviderKey, QueueTimeout, RetryPolicy
from iop_admission.core import AdmissionState, BudgetChanged, Ejected, Failed, Granted, Restored, Revoked, WaiterState

BIG = "ornith:35b"
FAST = "ornith-fast"


def _core(config: PoolConfig) -> AdmissionState:
    core = AdmissionState(config)
    for node in sorted({key.node_id for key in config.providers}):
        core.connect(node)
    return core


def test_lease_repr_names_id_provider_generation_kind_model_and_state(pool):
    """A lease's repr: id, provider, generation, ' long', ' probe', ' attempt N' (from 2 on),
    the model, then live / released / revoked (revoked wins over released)."""
    core = _core(pool.two_nodes(gpu0=pool.spec(capacity=2), gpu1=pool.spec(priority=-1)))
    normal = _lease(core.request(BIG, False, 0.0))
    assert repr(normal) == "<Lease 1 node-a/gpu0 gen 1 model 'ornith:35b' live>"
    long = _lease(core.request(FAST, True, 0.0))
    assert repr(long) == "<Lease 2 node-a/gpu0 gen 1 long model 'ornith-fast' live>"
    core.release(normal)
    assert repr(normal) == "<Lease 1 node-a/gpu0 gen 1 model 'ornith:35b' released>"
    again = _lease(core.retry(normal, 0.0))
    assert repr(again) == "<Lease 3 node-b/gpu1 gen 1 attempt 2 model 'ornith:35b' live>"
    core.connect("node-a")  # a new generation fences the long lease
    assert repr(long) == "<Lease 2 node-a/gpu0 gen 1 long model 'ornith-fast' revoked>"
    after = _lease(core.request(FAST, False, 0.0))
    assert repr(after) == "<Lease 4 node-a/gpu0 gen 2 model 'ornith-fast' live>"


def test_probe_lease_repr_says_probe_after_long(pool):
    """A long probe reads ' long probe'; its retry ' long attempt 2'."""
    config = attrs.evolve(
        pool.two_nodes(gpu1=pool.spec(priority=-1)), outlier=OutlierPolicy(1, 1.0, 4.0), retry=RetryPolicy(3)
    )
    core = _core(config)
    first = _lease(core.request(BIG, True, 0.0))
    assert first.provider == pool.gpu0
    core.release(first)
    core.report_failure(first, 0.0)
    core.advance(1.0)
    probe = _lease(core.request(BIG, True, 1.0))
    assert probe.probe
    core.release(probe)
    retried = _lease(core.retry(probe, 1.0))
    assert repr(probe) == "<Lease 2 node-a/gpu0 gen 1 long probe model 'ornith:35b' released>"
    assert repr(retried) == "<Lease 3 node-b/gpu1 gen 1 long attempt 2 model 'ornith:35b' live>"


def test_waiter_repr_names_seq_model_kind_attempt_and_state(pool):
    """A waiter's repr: arrival number, model, ' long', ' attempt N' (from 2 on), its state's value."""
    core = _core(pool.two_nodes(gpu1=pool.spec(priority=-1), queue_timeout=10.0))
    held = [_lease(core.request(BIG, False, 0.0)) for _ in range(2)]
    normal = _waiter(core.request(BIG, False, 1.0))
    long = _waiter(core.request(FAST, True, 1.0))
    assert repr(normal) == "<Waiter 3 'ornith:35b' queued>"
    assert repr(long) == "<Waiter 4 'ornith-fast' long queued>"
    [grant] = core.release(held[0])
    assert grant.waiter is normal
    assert repr(normal) == "<Waiter 3 'ornith:35b' granted>"
    retried = _waiter(core.retry(held[0], 2.0))
    assert repr(retried) == "<Waiter 1 'ornith:35b' attempt 2 queued>"
    assert core.withdraw(long)
    assert repr(long) == "<Waiter 4 'ornith-fast' long withdrawn>"
    assert core.expire(10.0) == [retried]
    assert repr(retried) == "<Waiter 1 'ornith:35b' attempt 2 timed_out>"
    assert (long.state, retried.state) == (WaiterState.WITHDRAWN, WaiterState.TIMED_OUT)


def test_decision_reprs(pool):
    """Granted shows both records, Failed the waiter and the error's type, Revoked the lease,
    Ejected the provider, the duration and the failures, Restored the provider, BudgetChanged the
    provider and the budget's move."""
    core = _core(pool.shared())
    lease = _lease(core.request(BIG, False, 0.0))
    waiter = _waiter(core.request(BIG, False, 0.0))
    [grant] = core.release(lease)
    assert isinstance(grant, Granted)
    assert repr(grant) == (
        "Granted(<Waiter 2 'ornith:35b' granted>, <Lease 2 node-a/gpu0 gen 1 model 'ornith:35b' live>)"
    )
    assert grant.waiter is waiter and grant.lease is waiter.lease
    _, [revoked] = core.disconnect("node-a", 1)
    assert isinstance(revoked, Revoked) and revoked.lease is waiter.lease
    assert repr(revoked) == "Revoked(<Lease 2 node-a/gpu0 gen 1 model 'ornith:35b' revoked>)"
    error = QueueTimeout(BIG, 1.0)
    failed = Failed(waiter, error)
    assert failed.waiter is waiter and failed.error is error
    assert repr(failed) == "Failed(<Waiter 2 'ornith:35b' granted>, QueueTimeout)"
    key = ProviderKey("node-a", "gpu0")
    ejected = Ejected(key, 12.5, 10.0, 3)
    assert (ejected.provider, ejected.until, ejected.duration, ejected.failures) == (key, 12.5, 10.0, 3)
    assert repr(ejected) == "Ejected(node-a/gpu0, 10.0s after 3 failures)"
    restored = Restored(key)
    assert restored.provider is key
    assert repr(restored) == "Restored(node-a/gpu0)"
    moved = BudgetChanged(key, 100, 80)
    assert (moved.provider, moved.before, moved.budget) == (key, 100, 80)
    assert repr(moved) == "BudgetChanged(node-a/gpu0, 100 -> 80 tokens)"


def test_fresh_lease_and_waiter_fields(pool):
    """A granted lease starts not revoked, not released, no probe, queue_wait 0, the default
    tenant and the cost asked; a queued waiter has no lease and no error, the default tenant,
    its enqueue time and deadline, attempt 1 and nothing tried."""
    core = _core(pool.shared(queue_timeout=7.0))
    lease = _lease(core.request(BIG, False, 2.0))
    assert (lease.released, lease.revoked, lease.probe, lease.queue_wait) == (False, False, False, 0.0)
    assert (lease.tenant, lease.cost, lease.attempt, lease.arrival) == ("default", 1.0, 1, 1)
    assert (lease.enqueue_time, lease.tried, lease.generation, lease.long) == (2.0, (pool.gpu0,), 1, False)
    waiter = _waiter(core.request(FAST, True, 3.0, cost=2.5))
    assert (waiter.seq, waiter.model, waiter.long, waiter.state) == (2, FAST, True, WaiterState.QUEUED)
    assert (waiter.enqueue_time, waiter.deadline, waiter.attempt, waiter.tried) == (3.0, 10.0, 1, ())
    assert (waiter.lease, waiter.error, waiter.tenant, waiter.cost) == (None, None, "default", 2.5)
    assert waiter.candidates == (pool.gpu0,)
    core.release(lease)
    assert waiter.lease is not None and (waiter.lease.cost, waiter.lease.tenant) == (2.5, "default")
    assert waiter.state is not WaiterState.FAILED

"""A model group's waiter deques under many withdrawals: once most of a deque is dead it is
rebuilt from its live waiters, and the waiters left are granted as before, each of its own kind,
in arrival order; withdrawals after the rebuild are counted as before."""

from __future__ import annotations

import pytest
from tests.admission.steps import as_lease as _lease
from tests.admission.steps import as_waiter as _waiter

from iop_admission.core import AdmissionState, Granted, Waiter

BIG = "ornith:35b"


@pytest.mark.parametrize("first_kind", [False, True])
def test_waiters_left_after_mass_withdrawals_are_granted_in_order_and_kind(pool, first_kind):
    """70 waiters of each kind are withdrawn around 2 kept ones of each kind (the deques are
    rebuilt on the way); the 4 kept are granted one after another, in arrival order, each with
    a lease of its own kind, and the queue is empty after; the provider's queued figures count
    the live waiters only."""
    core = AdmissionState(pool.shared(max_queue=400))
    core.connect("node-a")
    held = _lease(core.request(BIG, False, 0.0))
    kept: list[Waiter] = []
    gone: list[Waiter] = []
    for kind in (first_kind, not first_kind):
        kept.append(_waiter(core.request(BIG, kind, 0.0)))
        gone.extend(_waiter(core.request(BIG, kind, 0.0)) for _ in range(70))
        kept.append(_waiter(core.request(BIG, kind, 0.0)))
    for w in gone:
        assert core.withdraw(w)
    assert list(core.waiters()) == kept
    assert (core.provider_rows()[0]["queued"], core.provider_rows()[0]["long_queued"]) == (4, 2)
    granted: list[tuple[Waiter, bool]] = []
    lease = held
    for _ in kept:
        [decision] = core.release(lease)
        assert isinstance(decision, Granted)
        lease = decision.lease
        granted.append((decision.waiter, lease.long))
    assert granted == [(w, w.long) for w in kept]
    assert core.release(lease) == []
    assert core.queue_depth == 0
    assert (core.provider_rows()[0]["queued"], core.provider_rows()[0]["long_queued"]) == (0, 0)

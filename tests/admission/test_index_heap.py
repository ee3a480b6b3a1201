"""The choice heaps of a model group over many load changes of a candidate that is not its top:
the heap grows with stale entries until it is rebuilt from the fresh ones, and the choice after
the rebuild is still the rule's (priority, then load), for normal and long requests."""

from __future__ import annotations

import pytest
from tests.admission.steps import as_lease as _lease

from iop_admission import ModelGroup, PoolConfig, QueuePolicy
from iop_admission.core import AdmissionState, Waiter

BIG = "ornith:35b"
OTHER = "other"


@pytest.mark.parametrize("preferred_first", [True, False], ids=["preferred-at-0", "preferred-at-1"])
def test_choice_after_many_load_changes_of_the_other_candidate(pool, preferred_first):
    """BIG lists gpu0 then gpu1; the preferred one (priority 1) tops BIG's heaps. 100 grants and
    releases of another model on the other candidate push its entries under the top (and the
    heaps get rebuilt); BIG still fills the preferred candidate first, then the other, long and
    normal, then queues."""
    preferred, other = (pool.gpu0, pool.gpu1) if preferred_first else (pool.gpu1, pool.gpu0)
    config = PoolConfig(
        policy=QueuePolicy(max_queue=8, queue_timeout=30.0),
        providers={preferred: pool.spec(2, 1, priority=1), other: pool.spec(2, 1)},
        models={BIG: ModelGroup(candidates=(pool.gpu0, pool.gpu1)), OTHER: ModelGroup(candidates=(other,))},
    )
    core = AdmissionState(config)
    core.connect("node-a")
    core.connect("node-b")
    for i in range(100):
        lease = _lease(core.request(OTHER, i % 2 == 1, float(i)))
        assert lease.provider == other
        core.release(lease)
    got = [(_lease(core.request(BIG, long, 100.0)).provider, long) for long in (True, True, False, False)]
    assert got == [(preferred, True), (other, True), (preferred, False), (other, False)]
    assert isinstance(core.request(BIG, False, 100.0), Waiter)
    assert isinstance(core.request(BIG, True, 100.0), Waiter)

"""What the core shows a layer: ``read_snapshot``, the state's repr, and ``hold``'s refusal.

Sans-I/O tests with exact steps: the snapshot a layer serves counts the ejection time left
from the ``now`` it is given and selects the providers ``first``/``count`` name; the repr
reads the live counts; a negative count held elsewhere is refused with the count in the message.
"""

from __future__ import annotations

import pytest
from tests.admission.steps import as_lease as _lease

from iop_admission import ModelGroup, OutlierPolicy, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy
from iop_admission.core import AdmissionState, Waiter, read_snapshot

A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-b", "gpu1")
M = "m"


def _state() -> AdmissionState:
    """gpu0 (preferred) and gpu1, one slot each, one failure ejects for 4 s."""
    config = PoolConfig(
        policy=QueuePolicy(max_queue=8, queue_timeout=60.0),
        providers={
            A: ProviderSpec(capacity=1, long_context_capacity=0, priority=1),
            B: ProviderSpec(capacity=2, long_context_capacity=0),
        },
        models={M: ModelGroup(candidates=(A, B))},
        outlier=OutlierPolicy(1, 4.0, 8.0),
    )
    state = AdmissionState(config)
    for node in state.nodes():
        state.connect(node)
    return state


@pytest.mark.req("outlier-ejection")
def test_read_snapshot_counts_the_ejection_left_from_the_now_given() -> None:
    state = _state()
    failed = _lease(state.request(M, False, 0.0))
    assert failed.provider == A
    state.release(failed)
    state.report_failure(failed, 0.0)
    snap = read_snapshot(state, 1.0)
    assert [(p.provider_id, p.health, p.ejection_left) for p in snap.providers] == [
        ("gpu0", "ejected", 3.0),
        ("gpu1", "online", 0.0),
    ]
    assert snap.events_dropped == 0
    assert read_snapshot(state, None).providers[0].ejection_left == 4.0  # the latest time the state saw


def test_read_snapshot_selects_the_providers_first_and_count_name() -> None:
    state = _state()
    assert [p.provider_id for p in read_snapshot(state, 0.0, first=0, count=1).providers] == ["gpu0"]
    assert [p.provider_id for p in read_snapshot(state, 0.0, first=1).providers] == ["gpu1"]
    assert [p.provider_id for p in read_snapshot(state, 0.0, events_dropped=3).providers] == ["gpu0", "gpu1"]
    assert read_snapshot(state, 0.0, events_dropped=3).events_dropped == 3


def test_repr_shows_leases_in_flight_over_eligible_capacity_and_waiters() -> None:
    state = _state()
    assert repr(state) == "<AdmissionState 0/3 in flight with 0 waiting>"
    for _ in range(3):
        _lease(state.request(M, False, 0.0))
    assert isinstance(state.request(M, False, 0.0), Waiter)
    assert repr(state) == "<AdmissionState 3/3 in flight with 1 waiting>"
    state.disconnect("node-b", state.generation("node-b"))
    # gpu0 still runs its lease; node-b's two bodies have not left yet [revoked-in-flight]
    assert repr(state) == "<AdmissionState 1/1 in flight (2 revoked still running) with 1 waiting>"


@pytest.mark.req("held-elsewhere")
def test_hold_refuses_a_negative_count_naming_it() -> None:
    state = _state()
    with pytest.raises(ValueError, match=r"^runs held must be >= 0\b.*, got -1 and 0$"):
        state.hold(A, -1)

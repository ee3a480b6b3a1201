"""[outlier-ejection] A change of health re-examines the queue at once: an ejection grants the waiters
it puts in panic mode, a restore the waiters it lets in, and a disconnect that leaves a model only
ejected candidates puts it in panic mode. Sans-I/O, exact steps: without the dispatch each waiter
would wait for the next release (hand mutants of issue 44 that passed every other test).
"""

from __future__ import annotations

import pytest
from tests.admission.steps import as_lease as _lease
from tests.admission.steps import as_waiter as _waiter

from iop_admission import ModelGroup, OutlierPolicy, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy
from iop_admission.core import AdmissionState, Ejected, Granted, Restored, Revoked

A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-b", "gpu1")


def _state(capacity: dict[ProviderKey, int], models: dict[str, tuple[ProviderKey, ...]]) -> AdmissionState:
    state = AdmissionState(
        PoolConfig(
            policy=QueuePolicy(max_queue=8, queue_timeout=60.0),
            providers={k: ProviderSpec(capacity=c, long_context_capacity=0) for k, c in capacity.items()},
            models={name: ModelGroup(cands) for name, cands in models.items()},
            outlier=OutlierPolicy(consecutive_failures=1, base_ejection=5.0, max_ejection=5.0),
        )
    )
    for node in state.nodes():
        state.connect(node)
    return state


def _eject(state: AdmissionState, model: str) -> None:
    lease = _lease(state.request(model, False, 0.0))
    [ejected] = state.report_failure(lease, 0.0)
    assert isinstance(ejected, Ejected)
    assert state.release(lease) == []


@pytest.mark.req("outlier-ejection")
def test_an_ejection_grants_the_waiter_it_puts_in_panic_mode() -> None:
    """gpu1 is ejected; m's waiter waits for gpu0 (full, admitting). gpu0's lease fails: gpu0 is
    ejected too, m is in panic mode, and the ejection itself grants the waiter gpu1's free slot."""
    state = _state({A: 1, B: 1}, {"m": (A, B), "a": (A,), "b": (B,)})
    _eject(state, "b")
    on_a = _lease(state.request("a", False, 0.5))
    waiter = _waiter(state.request("m", False, 0.5))
    ejected, granted = state.report_failure(on_a, 0.5)
    assert isinstance(ejected, Ejected) and ejected.provider == A
    assert isinstance(granted, Granted) and granted.waiter is waiter and granted.lease.provider == B
    assert state.panic_models() == ("m", "a", "b")
    for lease in (on_a, granted.lease):
        state.release(lease)


@pytest.mark.req("outlier-ejection")
def test_a_restore_grants_the_waiter_it_lets_in() -> None:
    """gpu1 is ejected; b (gpu1 alone) is granted there in panic mode; bc's waiter waits for gpu0
    (full, admitting). The panic lease's success restores gpu1, and the restore grants the waiter."""
    state = _state({A: 1, B: 2}, {"bc": (B, A), "a": (A,), "b": (B,)})
    _eject(state, "b")
    on_a = _lease(state.request("a", False, 0.5))
    panic = _lease(state.request("b", False, 0.5))
    assert panic.provider == B and not panic.probe
    waiter = _waiter(state.request("bc", False, 0.5))
    restored, granted = state.report_success(panic, 1.0)
    assert isinstance(restored, Restored) and restored.provider == B
    assert isinstance(granted, Granted) and granted.waiter is waiter and granted.lease.provider == B
    for lease in (on_a, panic, granted.lease):
        state.release(lease)


@pytest.mark.req("outlier-ejection", "disconnect-queue-resolution")
def test_a_disconnect_that_leaves_only_ejected_candidates_grants_the_waiter_in_panic_mode() -> None:
    """gpu1 is ejected; m's waiter waits for gpu0 (full, admitting). node-a drops: gpu0 is gone,
    m's only eligible candidate is ejected, and the disconnect grants the waiter gpu1 in panic mode."""
    state = _state({A: 1, B: 1}, {"m": (A, B), "a": (A,), "b": (B,)})
    _eject(state, "b")
    on_a = _lease(state.request("a", False, 0.5))
    waiter = _waiter(state.request("m", False, 0.5))
    ok, decisions = state.disconnect("node-a", state.generation("node-a"))
    assert ok
    revoked, granted = decisions
    assert isinstance(revoked, Revoked) and revoked.lease is on_a
    assert isinstance(granted, Granted) and granted.waiter is waiter and granted.lease.provider == B
    assert not granted.lease.probe and state.panic_models() == ("m", "b")
    state.release(granted.lease)

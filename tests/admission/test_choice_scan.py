"""The choice by a scan (a retry's untried candidates) and the groups a refresh dispatches.

Sans-I/O: :class:`~iop_admission.core.AdmissionState` with exact steps.
"""

from __future__ import annotations

import attrs

from iop_admission import ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy
from iop_admission.core import AdmissionState, Granted, Lease, Waiter

P0, P1, P2 = (ProviderKey("node-a", f"gpu{i}") for i in range(3))


def _spec(capacity: int = 2, priority: int = 0) -> ProviderSpec:
    return ProviderSpec(
        capacity=capacity, long_context_capacity=0, context_window_tokens=0, total_context_tokens=0, priority=priority
    )


def _state(specs: dict[ProviderKey, ProviderSpec], models: dict[str, tuple[ProviderKey, ...]]) -> AdmissionState:
    config = PoolConfig(QueuePolicy(), specs, {m: ModelGroup(candidates=c) for m, c in models.items()})
    state = AdmissionState(config)
    state.connect("node-a")
    return state


def _lease(state: AdmissionState, model: str) -> Lease:
    lease = state.request(model, False, 0.0)
    assert isinstance(lease, Lease)
    return lease


def test_a_retry_takes_the_lowest_load_among_equal_priorities_the_first_of_them_too() -> None:
    """Equal priorities: the lowest load wins, also when it is the earlier candidate."""
    state = _state({P0: _spec(), P1: _spec(), P2: _spec()}, {"m": (P0, P1, P2), "only2": (P2,)})
    first = _lease(state, "m")  # on gpu0
    assert first.provider == P0
    _lease(state, "only2")  # gpu2 half loaded; gpu1 idle
    retried = state.retry(first, 0.0)
    assert isinstance(retried, Lease) and retried.provider == P1


def test_a_retry_takes_the_higher_priority_before_the_lower_load() -> None:
    state = _state({P0: _spec(), P1: _spec(priority=1), P2: _spec()}, {"m": (P0, P1, P2), "only1": (P1,)})
    first = state.request("m", False, 0.0)
    assert isinstance(first, Lease) and first.provider == P1  # the higher priority first
    _lease(state, "only1")  # gpu1 full now
    second = _lease(state, "m")  # gpu0 (idle, before gpu2)
    state.release(first)  # gpu1 half loaded, gpu2 idle, gpu0 half loaded by `second`
    retried = state.retry(second, 0.0)
    assert isinstance(retried, Lease) and retried.provider == P1


def test_a_refresh_dispatches_every_group_it_built() -> None:
    """Two models given a free candidate by one prepared refresh: both their waiters are granted."""
    specs = {P0: _spec(capacity=1), P1: _spec()}
    state = _state(specs, {"a": (P0,), "b": (P0,)})
    _lease(state, "a")
    waiting = [state.request(m, False, 0.0) for m in ("a", "b")]
    assert all(isinstance(w, Waiter) for w in waiting)
    wider = attrs.evolve(state.config, models={m: ModelGroup(candidates=(P0, P1)) for m in ("a", "b")})
    decisions = state.refresh(state.prepare_refresh(wider))
    granted = [d for d in decisions if isinstance(d, Granted)]
    assert {d.waiter for d in granted} == set(waiting)
    assert {d.lease.provider for d in granted} == {P1}


def test_a_retry_takes_the_earlier_of_equal_candidates() -> None:
    state = _state({P0: _spec(), P1: _spec(), P2: _spec()}, {"m": (P0, P1, P2)})
    first = _lease(state, "m")
    retried = state.retry(first, 0.0)
    assert isinstance(retried, Lease) and retried.provider == P1

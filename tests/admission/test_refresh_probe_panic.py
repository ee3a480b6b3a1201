"""A prepared refresh whose grant starts a probe grants whom that probe put in panic mode.

A prepared refresh dispatches only the model groups it built and those of the providers it
changed. When one of its grants is a provider's probe, that provider stops admitting, which can
put another model group of it -- kept by the refresh, not dispatched -- in panic mode: its
waiter must be granted in the same refresh (work conservation), as the direct refresh does.
"""

from __future__ import annotations

import pytest
from tests.admission.steps import as_lease as _lease
from tests.admission.steps import as_waiter as _waiter

from iop_admission import ModelGroup, OutlierPolicy, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy
from iop_admission.core import AdmissionState, Ejected, Granted

P = ProviderKey("node-p", "gpu0")
Q = ProviderKey("node-q", "gpu1")
R = ProviderKey("node-r", "gpu2")
PROVIDERS = {
    P: ProviderSpec(capacity=2, long_context_capacity=1, priority=1),
    Q: ProviderSpec(capacity=1, long_context_capacity=1),
    R: ProviderSpec(capacity=1, long_context_capacity=0),
}


def _config(h: tuple[ProviderKey, ...]) -> PoolConfig:
    """g lists gpu0 and gpu1; p, q only gpu0 and gpu1; h the candidates given."""
    return PoolConfig(
        policy=QueuePolicy(queue_timeout=60.0),
        providers=PROVIDERS,
        models={
            "g": ModelGroup(candidates=(P, Q)),
            "p": ModelGroup(candidates=(P,)),
            "q": ModelGroup(candidates=(Q,)),
            "h": ModelGroup(candidates=h),
        },
        outlier=OutlierPolicy(1, 10.0, 20.0),
    )


def _eject(state: AdmissionState, model: str, now: float) -> None:
    failed = _lease(state.request(model, False, now))
    state.release(failed)
    assert any(isinstance(d, Ejected) for d in state.report_failure(failed, now))


@pytest.mark.req("outlier-ejection", "refresh-consistency")
@pytest.mark.parametrize("prepared", [False, True])
def test_refresh_starting_a_probe_grants_the_waiter_it_puts_in_panic_mode(prepared: bool) -> None:
    """gpu0's ejection is over (probe due) while a long lease still holds its long slot; gpu1 is
    ejected. g's long waiter waits for gpu0's long slot (gpu0 admits: no panic). The refresh
    gives h (waiting for gpu2) gpu0 as a candidate: h's waiter gets gpu0's probe, g has no
    admitting long candidate left, and g's long waiter is granted gpu1 in panic mode."""
    state = AdmissionState(_config((R,)))
    for node in state.nodes():
        state.connect(node)
    long_on_p = _lease(state.request("g", True, 0.0))
    assert long_on_p.provider == P
    _eject(state, "p", 0.0)  # gpu0 ejected until 10
    _eject(state, "q", 5.0)  # gpu1 ejected until 15
    assert _lease(state.request("h", False, 5.0)).provider == R
    h_waiter = _waiter(state.request("h", False, 5.0))
    state.advance(10.0)  # gpu0's probe is due
    g_waiter = _waiter(state.request("g", True, 10.0))
    assert state.panic_models() == ("q",)
    target = _config((R, P))
    decisions = state.refresh(state.prepare_refresh(target) if prepared else target)
    grants = [(d.waiter, d.lease.provider, d.lease.probe) for d in decisions if isinstance(d, Granted)]
    assert grants == [(h_waiter, P, True), (g_waiter, Q, False)]
    assert list(state.waiters()) == []

"""[health-probe] A node's own reports of its providers in the core and on both layers: what each
state does to the provider's health and capacity, what the snapshot shows, and what a stale
report or a reconnect does. The random paths are the active health machine's
(``test_active_health_machine.py``)."""

from __future__ import annotations

import asyncio
import math

import pytest

from iop_admission import (
    Admission,
    ModelGroup,
    OutlierPolicy,
    PoolConfig,
    ProviderKey,
    ProviderReport,
    ProviderSpec,
    QueuePolicy,
)
from iop_admission.aio import AsyncAdmission
from iop_admission.core import AdmissionState, Ejected, Granted, Lease, Restored, Waiter

A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-b", "gpu0")
pytestmark = pytest.mark.req("health-probe")


def _health_pool() -> PoolConfig:
    return PoolConfig(
        policy=QueuePolicy(max_queue=10, queue_timeout=60.0),
        providers={k: ProviderSpec(capacity=4, long_context_capacity=1) for k in (A, B)},
        models={"m": ModelGroup((A, B)), "a": ModelGroup((A,))},
        outlier=OutlierPolicy(consecutive_failures=3, base_ejection=5.0, max_ejection=20.0),
    )


def _state() -> AdmissionState:
    state = AdmissionState(_health_pool())
    state.connect("node-a")
    state.connect("node-b")
    return state


def _row(state: AdmissionState, key: ProviderKey) -> tuple[str, str, str, float, int]:
    snap = next(s for s in state.provider_snapshots() if (s.node_id, s.provider_id) == (key.node_id, key.provider_id))
    return snap.health, snap.reported, snap.report_reason, snap.ejection_left, snap.effective_capacity


def test_stalled_ejects_as_failures_would_and_ready_does_not_end_it() -> None:
    """A stall ejects for the outlier time (then a probe decides); a ready report meanwhile (the hung
    engine answering its probe) leaves the ejection; a second stall while ejected changes nothing."""
    state = _state()
    [ejected] = state.report_health(A, ProviderReport("stalled", "no byte for 6.0 s"), 10.0)
    assert type(ejected) is Ejected and (ejected.until, ejected.duration) == (15.0, 5.0)
    assert _row(state, A) == ("ejected", "stalled", "no byte for 6.0 s", 5.0, 4)
    assert state.report_health(A, ProviderReport("ready"), 11.0) == []
    assert state.report_health(A, ProviderReport("stalled"), 11.0) == []
    assert _row(state, A)[:2] == ("ejected", "stalled")
    assert state.advance(15.0) == []
    probe = state.request("a", False, 15.0)
    assert type(probe) is Lease and probe.probe
    [again] = state.report_health(A, ProviderReport("stalled"), 16.0)  # still hung while probed
    assert type(again) is Ejected and again.duration == 10.0


def test_not_ready_ejects_until_ready_without_a_probe() -> None:
    """Not ready: no end time, no probe however long; other candidates serve meanwhile; ready
    restores at once (and lets a waiter in)."""
    state = _state()
    [held] = state.report_health(A, ProviderReport("not_ready", "loading (Loading model)"), 0.0)
    assert type(held) is Ejected and held.until == math.inf
    assert state.next_ejection_end() is None
    assert _row(state, A) == ("ejected", "not_ready", "loading (Loading model)", 0.0, 4)
    assert state.advance(1_000.0) == []
    lease = state.request("m", False, 1_000.0)
    assert type(lease) is Lease and lease.provider == B
    waiter = state.request("a", False, 1_000.0)  # only A: panic mode grants it anyway
    assert type(waiter) is Lease and waiter.provider == A and not waiter.probe
    restored, *grants = state.report_health(A, ProviderReport("ready"), 1_001.0)
    assert type(restored) is Restored and grants == []
    assert _row(state, A)[:2] == ("online", "ready")


def test_a_reported_capacity_lowers_the_provider_never_raises_it() -> None:
    """ready with its backend's own 2 slots: 2 grants, then the others wait or go elsewhere; None
    gives the configured 4 back, and a waiter is granted at once."""
    state = _state()
    assert state.report_health(A, ProviderReport("ready", capacity=2), 0.0) == []
    assert _row(state, A)[4] == 2
    first, second = (state.request("a", False, 0.0) for _ in range(2))
    assert type(first) is Lease and type(second) is Lease
    waiter = state.request("a", False, 0.0)
    assert type(waiter) is Waiter
    [granted] = state.report_health(A, ProviderReport("ready"), 1.0)
    assert type(granted) is Granted and granted.waiter is waiter
    assert _row(state, A)[4] == 4


def test_stale_reports_change_nothing_and_a_reconnect_starts_the_reports_over() -> None:
    """An older generation's report, a node offline, a provider not configured: nothing. A
    reconnect ends an ejection until ready and clears the reports (the node sends them again);
    an ejection for a stall outlives it."""
    state = _state()
    generation = state.generation("node-a")
    before = state.provider_snapshots()
    assert state.report_health(A, ProviderReport("stalled", generation=generation - 1), 0.0) == []
    assert state.report_health(ProviderKey("node-a", "nope"), ProviderReport("stalled"), 0.0) == []
    assert state.provider_snapshots() == before
    state.report_health(A, ProviderReport("not_ready", capacity=None), 0.0)
    state.report_health(B, ProviderReport("stalled"), 0.0)
    generation_a, decisions = state.connect("node-a")
    assert [type(d) for d in decisions] == [Restored] and generation_a == generation + 1
    assert _row(state, A)[:2] == ("online", "")
    _, decisions = state.connect("node-b")
    assert decisions == [] and _row(state, B)[:2] == ("ejected", "")
    done, _ = state.disconnect("node-a", generation_a)
    assert done and state.report_health(A, ProviderReport("not_ready"), 1.0) == []


def test_the_report_refuses_what_is_not_a_report() -> None:
    with pytest.raises(ValueError, match="state"):
        ProviderReport("sleepy")
    with pytest.raises(ValueError, match="capacity"):
        ProviderReport("ready", capacity=0)


async def test_the_trio_layer_takes_reports() -> None:
    """Admission.report_health: the ejection and its event, on the trio layer's clock."""
    admission = Admission(_health_pool())
    admission.connect("node-a")
    admission.connect("node-b")
    async with admission.subscribe(buffer=16) as events:
        admission.report_health(A, ProviderReport("stalled", "no byte for 6.0 s"))
        event = await events.receive()
    assert (event.kind, event.provider) == ("ejected", A)
    snap = admission.snapshot().provider("node-a", "gpu0")
    assert (snap.health, snap.reported, snap.report_reason) == ("ejected", "stalled", "no byte for 6.0 s")


def test_the_asyncio_layer_takes_reports() -> None:
    """AsyncAdmission.report_health: the same call and the same result under asyncio."""

    async def main() -> tuple[str, str]:
        admission = AsyncAdmission(_health_pool())
        admission.connect("node-a")
        admission.report_health(A, ProviderReport("not_ready", "loading"))
        snap = admission.snapshot().provider("node-a", "gpu0")
        return snap.health, snap.reported

    assert asyncio.run(main()) == ("ejected", "not_ready")

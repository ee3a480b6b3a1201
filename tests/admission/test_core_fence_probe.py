"""Fencing a probe lease whose probe is over leaves its provider's health alone.

A probe whose success restored its provider may still be running when its node disconnects.
Fencing it must not reopen a probe on the restored provider: after the node reconnects, the
provider is healthy and its next grant is an ordinary lease, not a second probe.
"""

from __future__ import annotations

import pytest
from tests.admission.steps import as_lease as _lease

from iop_admission import ModelGroup, OutlierPolicy, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy
from iop_admission.core import AdmissionState, Restored, Revoked

A = ProviderKey("node-a", "gpu0")
M = "m"


@pytest.mark.req("outlier-ejection")
def test_fencing_a_probe_that_restored_its_provider_opens_no_new_probe() -> None:
    state = AdmissionState(
        PoolConfig(
            policy=QueuePolicy(queue_timeout=60.0),
            providers={A: ProviderSpec(capacity=2, long_context_capacity=0)},
            models={M: ModelGroup(candidates=(A,))},
            outlier=OutlierPolicy(1, 1.0, 4.0),
        )
    )
    state.connect("node-a")
    failed = _lease(state.request(M, False, 0.0))
    state.release(failed)
    state.report_failure(failed, 0.0)
    state.advance(1.0)
    probe = _lease(state.request(M, False, 1.0))
    assert probe.probe
    assert any(isinstance(d, Restored) for d in state.report_success(probe, 1.0))
    ok, decisions = state.disconnect("node-a", state.generation("node-a"))
    assert ok and [type(d) for d in decisions] == [Revoked] and probe.revoked
    state.connect("node-a")
    [snap] = state.provider_snapshots()
    assert (snap.health, snap.probes) == ("online", 1)
    after = _lease(state.request(M, False, 2.0))
    assert not after.probe


def test_disconnect_fences_every_provider_of_the_node_after_an_idle_one() -> None:
    """node-a has an idle gpu0 and a busy gpu1: its disconnect revokes gpu1's lease too."""
    idle, busy = ProviderKey("node-a", "gpu0"), ProviderKey("node-a", "gpu1")
    state = AdmissionState(
        PoolConfig(
            policy=QueuePolicy(queue_timeout=60.0),
            providers={
                idle: ProviderSpec(capacity=1, long_context_capacity=0),
                busy: ProviderSpec(capacity=1, long_context_capacity=0),
            },
            models={M: ModelGroup(candidates=(busy,)), "idle": ModelGroup(candidates=(idle,))},
        )
    )
    state.connect("node-a")
    running = _lease(state.request(M, False, 0.0))
    ok, decisions = state.disconnect("node-a", state.generation("node-a"))
    assert ok and [(type(d), getattr(d, "lease", None)) for d in decisions] == [(Revoked, running)]
    assert running.revoked and list(state.live_leases()) == []
    assert [p.in_flight for p in state.provider_snapshots()] == [0, 0]


@pytest.mark.req("held-elsewhere", "disconnect-exclusion")
@pytest.mark.parametrize("how", ["disconnect", "reconnect"])
def test_fencing_forgets_the_long_runs_held_elsewhere_too(how: str) -> None:
    """Runs held elsewhere (one of them long) belong to the node's connection: fencing it, by a
    disconnect or a reconnect, drops both counts, so a new count of one run (not long) leaves the
    long slot free for a long request, and ending that count leaves nothing behind."""
    state = AdmissionState(
        PoolConfig(
            policy=QueuePolicy(queue_timeout=60.0),
            providers={A: ProviderSpec(capacity=3, long_context_capacity=1)},
            models={M: ModelGroup(candidates=(A,))},
        )
    )
    state.connect("node-a")
    assert state.hold(A, 2, 1) == []
    if how == "disconnect":
        state.disconnect("node-a", state.generation("node-a"))
    state.connect("node-a")
    assert state.hold(A, 1) == []
    (row,) = state.provider_snapshots()
    assert (row.in_flight, row.long_in_flight) == (1, 0)
    long = _lease(state.request(M, True, 1.0))
    assert state.release(long) == []
    assert state.hold(A, 0) == []
    (row,) = state.provider_snapshots()
    assert (row.in_flight, row.long_in_flight) == (0, 0)

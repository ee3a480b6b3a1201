"""Small steps the sans-I/O tests of the core share: narrowing what ``request`` or ``retry`` returned."""

from __future__ import annotations

from iop_admission import PoolConfig, ProviderKey
from iop_admission.core import AdmissionState, Decision, Granted, Lease, Waiter

__all__ = ["as_lease", "as_waiter", "connected", "grants"]


def as_lease(result: Lease | Waiter) -> Lease:
    """``result``, which must be a lease (granted at once)."""
    assert isinstance(result, Lease), result
    return result


def as_waiter(result: Lease | Waiter) -> Waiter:
    """``result``, which must be a waiter (queued)."""
    assert isinstance(result, Waiter), result
    return result


def connected(config: PoolConfig) -> AdmissionState:
    """A core for ``config`` with every node connected."""
    state = AdmissionState(config)
    for node in state.nodes():
        state.connect(node)
    return state


def grants(decisions: list[Decision]) -> list[tuple[Waiter, ProviderKey]]:
    """``decisions``, which must all be grants: each waiter with the provider it was granted on."""
    assert all(type(d) is Granted for d in decisions), decisions
    return [(d.waiter, d.lease.provider) for d in decisions if isinstance(d, Granted)]

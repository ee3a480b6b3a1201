"""A node that disconnects fails exactly the waiters it leaves with no candidate that could run them.

Sans-I/O tests with exact steps: a queued retry keeps waiting while an untried candidate is
left, and fails with ``Unavailable`` once none is; a long waiter or long retry fails when
only candidates without a long slot are left, while a normal waiter of the same model waits on.
"""

from __future__ import annotations

import pytest
from tests.admission.steps import as_lease as _lease
from tests.admission.steps import as_waiter as _waiter

from iop_admission import ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy, Unavailable
from iop_admission.core import AdmissionState, Failed, Lease, Revoked, Waiter, WaiterState

A = ProviderKey("node-a", "gpu0")
X = ProviderKey("node-x", "gpu1")
Y = ProviderKey("node-y", "gpu2")
M = "m"


def _state(providers: dict[ProviderKey, ProviderSpec]) -> AdmissionState:
    state = AdmissionState(
        PoolConfig(
            policy=QueuePolicy(queue_timeout=60.0),
            providers=providers,
            models={M: ModelGroup(candidates=tuple(providers))},
        )
    )
    for node in state.nodes():
        state.connect(node)
    return state


def _disconnect(state: AdmissionState, node: str) -> list[object]:
    ok, decisions = state.disconnect(node, state.generation(node))
    assert ok
    return list(decisions)


def _revoked(decision: object) -> Lease:
    assert isinstance(decision, Revoked), decision
    return decision.lease


def _failed_unavailable(decision: object, waiter: Waiter, long: bool) -> None:
    assert isinstance(decision, Failed) and decision.waiter is waiter
    assert isinstance(decision.error, Unavailable) and (decision.error.model, decision.error.long) == (M, long)
    assert waiter.state is WaiterState.FAILED and waiter.error is decision.error


@pytest.mark.req("failover-before-first-byte")
def test_disconnects_fail_a_queued_long_retry_only_when_no_untried_long_slot_is_left() -> None:
    """The long retry of gpu0's lease has gpu1 (no long slot) and gpu2 (long slot busy) left.
    gpu0's node going (tried already) leaves it queued; gpu2's node going fails it."""
    state = _state(
        {
            A: ProviderSpec(capacity=1, long_context_capacity=1, priority=2),
            X: ProviderSpec(capacity=1, long_context_capacity=0, priority=1),
            Y: ProviderSpec(capacity=1, long_context_capacity=1),
        }
    )
    first = _lease(state.request(M, True, 0.0))
    on_y = _lease(state.request(M, True, 0.0))
    assert (first.provider, on_y.provider) == (A, Y)
    assert _lease(state.request(M, False, 0.0)).provider == X
    retried = _waiter(state.retry(first, 1.0))
    [revoked_first] = _disconnect(state, "node-a")
    assert _revoked(revoked_first) is first
    assert retried.state is WaiterState.QUEUED and list(state.waiters()) == [retried]
    revoked, failed = _disconnect(state, "node-y")
    assert _revoked(revoked) is on_y
    _failed_unavailable(failed, retried, True)
    assert list(state.waiters()) == []


@pytest.mark.req("long-state")
def test_disconnect_fails_long_waiters_left_without_a_long_slot_and_keeps_normal_ones() -> None:
    """m on gpu1 (no long slot) and gpu2 (one long slot, busy): gpu2's node going fails the long
    waiter and leaves the normal one queued for gpu1."""
    state = _state(
        {
            X: ProviderSpec(capacity=1, long_context_capacity=0),
            Y: ProviderSpec(capacity=1, long_context_capacity=1),
        }
    )
    on_y = _lease(state.request(M, True, 0.0))
    long_waiter = _waiter(state.request(M, True, 0.0))
    assert _lease(state.request(M, False, 0.0)).provider == X
    normal_waiter = _waiter(state.request(M, False, 0.0))
    revoked, failed = _disconnect(state, "node-y")
    assert _revoked(revoked) is on_y
    _failed_unavailable(failed, long_waiter, True)
    assert normal_waiter.state is WaiterState.QUEUED and list(state.waiters()) == [normal_waiter]

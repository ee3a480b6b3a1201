"""What a request that cannot be admitted or queued raises, and what a grant leaves on its waiter.

Sans-I/O tests with exact steps (no tenants): ``ModelNotFound`` names the model asked for;
``Unavailable`` names the model, the kind and why each candidate cannot run it; a waiter
granted later holds its lease.
"""

from __future__ import annotations

import pytest

from iop_admission import (
    ModelGroup,
    ModelNotFound,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    QueueFull,
    QueuePolicy,
    Unavailable,
)
from iop_admission.core import AdmissionState, Granted, Lease, Waiter, WaiterState

A = ProviderKey("node-a", "gpu0")
M = "m"


def _state() -> AdmissionState:
    return AdmissionState(
        PoolConfig(
            policy=QueuePolicy(queue_timeout=60.0),
            providers={A: ProviderSpec(capacity=1, long_context_capacity=0)},
            models={M: ModelGroup(candidates=(A,))},
        )
    )


def test_request_for_a_model_not_configured_names_it() -> None:
    with pytest.raises(ModelNotFound) as raised:
        _state().request("nope", False, 0.0)
    assert raised.value.model == "nope"


@pytest.mark.parametrize("long", [False, True])
def test_request_with_no_eligible_candidate_is_unavailable_naming_model_kind_and_reasons(long: bool) -> None:
    state = _state()  # node-a never connected
    with pytest.raises(Unavailable) as raised:
        state.request(M, long, 0.0)
    assert (raised.value.model, raised.value.long) == (M, long)
    assert raised.value.reasons == ("node-a/gpu0: node 'node-a' is not connected (call connect('node-a'))",)
    assert state.queue_depth == 0


def test_waiter_granted_later_holds_its_lease() -> None:
    state = _state()
    state.connect("node-a")
    held = state.request(M, False, 0.0)
    waiting = state.request(M, False, 0.0)
    assert isinstance(held, Lease) and isinstance(waiting, Waiter) and waiting.lease is None
    [grant] = state.release(held)
    assert isinstance(grant, Granted) and grant.waiter is waiting
    assert waiting.state is WaiterState.GRANTED and waiting.lease is grant.lease


def test_long_request_without_a_long_slot_anywhere_is_unavailable_saying_so() -> None:
    state = _state()
    state.connect("node-a")
    with pytest.raises(Unavailable) as raised:
        state.request(M, True, 0.0)
    assert raised.value.reasons == ("node-a/gpu0: runs no long requests (long_context_capacity=0)",)


def test_full_queue_refuses_a_request_naming_the_model_and_the_bound() -> None:
    state = AdmissionState(
        PoolConfig(
            policy=QueuePolicy(max_queue=1, queue_timeout=60.0),
            providers={A: ProviderSpec(capacity=1, long_context_capacity=0)},
            models={M: ModelGroup(candidates=(A,))},
        )
    )
    state.connect("node-a")
    assert isinstance(state.request(M, False, 0.0), Lease)
    assert isinstance(state.request(M, False, 0.0), Waiter)
    with pytest.raises(QueueFull) as raised:
        state.request(M, False, 0.0)
    assert (raised.value.model, raised.value.max_queue) == (M, 1)


def test_arrival_numbers_count_from_one_in_request_order_granted_or_queued() -> None:
    state = _state()
    state.connect("node-a")
    first = state.request(M, False, 0.0)
    second = state.request(M, False, 0.0)
    assert isinstance(first, Lease) and isinstance(second, Waiter)
    assert (first.id, first.arrival, second.seq) == (1, 1, 2)

"""[outlier-ejection] [tenant-quotas] [token-ledger] One ``drain_decisions()`` with two decisions or more.

Sans-I/O, exact steps. A hand mutant that handed over only the first decision of a drain passed
the whole admission suite: no test reached a drain of two. The ways there: a grant that starts
the last admitting candidate's probe puts two long waiters in panic mode (through a new request
or a retry); a full queue sheds a waiter whose tokens were held as headroom, and the room it
gives back lets the newcomer in; a pinned waiter withdrawn, or timed out, gives back the
headroom that two smaller waiters fit in.

A shed and a panic grant come out of one drain only through the ledger: a request is either granted
at once (and only a grant starts a probe) or queued (and only a queued request sheds), but the
headroom a shed waiter gives back may let a waiter take a probe, which puts the rest in panic mode.
"""

from __future__ import annotations

import pytest
from tests.admission.steps import as_lease as _lease
from tests.admission.steps import as_waiter as _waiter
from tests.admission.steps import connected as _connected
from tests.admission.steps import grants as _grants

from iop_admission import (
    ModelGroup,
    OutlierPolicy,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    QueuePolicy,
    TenantLimitExceeded,
    TenantSpec,
)
from iop_admission.core import AdmissionState, Ejected, Failed, Granted, TokenLedger, Waiter, WaiterState

A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-b", "gpu1")


# ------------------------------------------------------------------ probe start


def _health_pool() -> AdmissionState:
    """``m`` on A (two long slots) and B (one); ``a`` on A, ``b`` on B; one failure ejects for 1 s."""
    return _connected(
        PoolConfig(
            policy=QueuePolicy(max_queue=10, queue_timeout=60.0),
            providers={
                A: ProviderSpec(capacity=4, long_context_capacity=2),
                B: ProviderSpec(capacity=4, long_context_capacity=1),
            },
            models={"m": ModelGroup((A, B)), "a": ModelGroup((A,)), "b": ModelGroup((B,))},
            outlier=OutlierPolicy(consecutive_failures=1, base_ejection=1.0, max_ejection=1.0),
        )
    )


@pytest.mark.req("outlier-ejection", "failover-before-first-byte")
@pytest.mark.parametrize("via", ["request", "retry"])
def test_a_probe_start_that_puts_two_waiters_in_panic_mode_drains_both_grants(via: str) -> None:
    """B's long slot is taken; A and B are ejected and their time is over; A's probe is out. Two
    long requests of ``m`` wait (A probes, B admits but has no long slot). B's probe goes to a new
    request, or to a retry of an attempt that failed on A: nothing of ``m`` admits, both waiters
    are in panic mode, and A's two long slots take them, in arrival order, in one drain."""
    state = _health_pool()
    first = _lease(state.request("m", False, 0.0))  # the attempt a retry fails over from
    assert first.provider == A
    b_long = _lease(state.request("b", True, 0.0))
    for model in ("a", "b"):
        failed = _lease(state.request(model, False, 0.0))
        state.report_failure(failed, 0.0)
        assert state.release(failed) == []
    assert state.advance(1.0) == []
    a_probe = _lease(state.request("a", False, 1.0))
    assert a_probe.probe
    waiters = [_waiter(state.request("m", True, 1.0)) for _ in range(2)]
    assert state.drain_decisions() == [] and state.release(first) == []
    if via == "request":
        b_probe = _lease(state.request("m", False, 1.0))
    else:
        b_probe = _lease(state.retry(first, 1.0))
        assert b_probe.attempt == 2
    assert b_probe.probe and b_probe.provider == B
    drained = state.drain_decisions()
    assert _grants(drained) == [(waiters[0], A), (waiters[1], A)]
    assert all(d.lease.long and not d.lease.probe for d in drained if isinstance(d, Granted))
    assert state.queue_depth == 0 and state.drain_decisions() == []
    for lease in (b_long, a_probe, b_probe, *(w.lease for w in waiters)):
        assert lease is not None
        state.release(lease)
    assert not list(state.live_leases())


# ----------------------------------------------------------- tokens given back


def _tokens(budget: int = 100, tenants: tuple[TenantSpec, ...] = (), max_queue: int = 8) -> AdmissionState:
    spec = ProviderSpec(capacity=16, total_context_tokens=budget, admit_by="tokens")
    return _connected(
        PoolConfig(
            policy=QueuePolicy(max_queue=max_queue, queue_timeout=10.0),
            providers={A: spec},
            models={"m": ModelGroup((A,))},
            tenants=tenants,
        )
    )


def _headroom(state: AdmissionState) -> int:
    return state.provider_snapshots()[0].token_headroom


@pytest.mark.req("tenant-quotas", "token-ledger")
def test_a_shed_pinned_waiter_gives_back_the_headroom_the_newcomer_runs_in() -> None:
    """Budget 100, a queue of one. ``low`` (band -1) waits with 60 tokens beside 50 running; two
    40s of ``high`` pass it (80 tokens: more than its size) and pin it, 60 held. A 10 of ``high``
    does not fit beside the headroom (90 + 10 + 60) and finds the queue full: ``low``'s waiter is
    shed, its headroom goes, and the same drain grants the newcomer (90 + 10)."""
    state = _tokens(tenants=(TenantSpec("high"), TenantSpec("low", priority=-1)), max_queue=1)
    _lease(state.request("m", False, 0.0, "high", tokens=50))
    big = _waiter(state.request("m", False, 0.0, "low", tokens=60))
    passing = _lease(state.request("m", False, 0.0, "high", tokens=40))
    assert state.release(passing) == [] and _headroom(state) == 0
    _lease(state.request("m", False, 0.0, "high", tokens=40))
    assert _headroom(state) == 60
    newcomer = _waiter(state.request("m", False, 1.0, "high", tokens=10))
    shed, granted = state.drain_decisions()
    assert isinstance(shed, Failed) and shed.waiter is big and big.state is WaiterState.FAILED
    assert isinstance(shed.error, TenantLimitExceeded) and shed.error.tenant == "low"
    assert isinstance(granted, Granted) and granted.waiter is newcomer and granted.lease.reserved_tokens == 10
    assert (_headroom(state), state.provider_snapshots()[0].reserved_tokens, state.queue_depth) == (0, 100, 0)


@pytest.mark.req("tenant-quotas", "token-ledger", "outlier-ejection")
def test_a_shed_pinned_waiter_lets_a_probe_and_a_panic_grant_in_in_one_drain() -> None:
    """A's ejection is over (its next grant is its probe). ``low``'s 60 waits beside 50 running,
    pinned there by two 40s of ``high`` (the second fails: that ejected A). A 0 of ``high`` waits
    behind the headroom (50 + 0 + 60 held) and the queue of two is full. A 10 of ``high`` sheds the
    60; the drain grants the 0 A's probe, and the 10 in the panic mode that puts ``a`` in."""
    state = _connected(
        PoolConfig(
            policy=QueuePolicy(max_queue=2, queue_timeout=10.0),
            providers={A: ProviderSpec(capacity=16, total_context_tokens=100, admit_by="tokens")},
            models={"a": ModelGroup((A,))},
            outlier=OutlierPolicy(consecutive_failures=1, base_ejection=1.0, max_ejection=1.0),
            tenants=(TenantSpec("high"), TenantSpec("low", priority=-1)),
        )
    )
    _lease(state.request("a", False, 0.0, "high", tokens=50))
    big = _waiter(state.request("a", False, 0.0, "low", tokens=60))
    assert state.release(_lease(state.request("a", False, 0.0, "high", tokens=40))) == []
    failing = _lease(state.request("a", False, 0.0, "high", tokens=40))
    assert _headroom(state) == 60
    assert [type(d) for d in state.report_failure(failing, 0.0)] == [Ejected]
    assert state.release(failing) == [] and state.advance(1.0) == []
    empty = _waiter(state.request("a", False, 1.0, "high", tokens=0))
    newcomer = _waiter(state.request("a", False, 1.0, "high", tokens=10))
    shed, probe, panic = state.drain_decisions()
    assert isinstance(shed, Failed) and shed.waiter is big and isinstance(big.error, TenantLimitExceeded)
    assert isinstance(probe, Granted) and probe.waiter is empty and probe.lease.probe
    assert isinstance(panic, Granted) and panic.waiter is newcomer and not panic.lease.probe
    assert state.panic_models() == ("a",) and state.queue_depth == 0 and _headroom(state) == 0


def _pinned_with_two_behind(monkeypatch: pytest.MonkeyPatch) -> tuple[AdmissionState, Waiter, list[Waiter]]:
    """Budget 100: 50 runs, a 60 waits (arrived at 0) and is pinned by a 10 that passes it (patience
    0); two 20s (arrived at 1) wait: 60 + 20 + 60 held > 100, though 60 + 20 + 20 fit."""
    monkeypatch.setattr(TokenLedger, "PATIENCE", 0)
    state = _tokens()
    _lease(state.request("m", False, 0.0, tokens=50))
    big = _waiter(state.request("m", False, 0.0, tokens=60))
    _lease(state.request("m", False, 0.0, tokens=10))
    assert _headroom(state) == 60
    small = [_waiter(state.request("m", False, 1.0, tokens=20)) for _ in range(2)]
    assert state.drain_decisions() == []
    return state, big, small


@pytest.mark.req("token-ledger")
def test_a_withdrawn_pinned_waiter_lets_two_smaller_waiters_in_in_one_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    state, big, small = _pinned_with_two_behind(monkeypatch)
    assert state.withdraw(big)
    assert _grants(state.drain_decisions()) == [(small[0], A), (small[1], A)]
    assert (_headroom(state), state.provider_snapshots()[0].reserved_tokens, state.queue_depth) == (0, 100, 0)


@pytest.mark.req("token-ledger", "queue-ownership")
def test_a_pinned_waiter_timing_out_lets_two_smaller_waiters_in_in_one_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 60's deadline (10 s) comes before the 20s' (11 s): it alone expires, and the drain after
    the expiry grants both 20s in the room its headroom held."""
    state, big, small = _pinned_with_two_behind(monkeypatch)
    assert state.expire(10.0) == [big]
    assert big.state is WaiterState.TIMED_OUT
    assert _grants(state.drain_decisions()) == [(small[0], A), (small[1], A)]
    assert (_headroom(state), state.queue_depth) == (0, 0)

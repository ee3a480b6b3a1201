"""[token-ledger] The ledger's paths that only the hand mutants of issue 40's code found untested.

Sans-I/O, exact steps, patience 0 where a pin is wanted at the first pass: a waiter pinned on one
provider and granted on another gives its headroom back, and the same dispatch grants whom that
lets in.
"""

from __future__ import annotations

import pytest
from tests.admission.steps import as_lease as _lease
from tests.admission.steps import as_waiter as _waiter
from tests.admission.steps import connected, grants
from tests.admission.token_pools import A, B, token_pool, tokens_spec

from iop_admission import ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy, TenantSpec
from iop_admission.core import AdmissionState, TokenLedger

pytestmark = pytest.mark.req("token-ledger")


def _two(a: ProviderSpec | None = None, b: ProviderSpec | None = None) -> PoolConfig:
    """``x`` on A and B, ``a`` on A alone, ``b`` on B alone; budgets of 100 tokens by default."""
    return token_pool(a or tokens_spec(), b or tokens_spec(), models={"x": (A, B), "a": (A,), "b": (B,)})


def _headroom(state: AdmissionState) -> dict[ProviderKey, int]:
    return {ProviderKey(r.node_id, r.provider_id): r.token_headroom for r in state.provider_snapshots()}


def test_a_waiter_pinned_on_one_provider_and_granted_on_another_frees_its_headroom_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """60 runs on A and 60 on B; a 50 of ``x`` fits neither and waits. A 30 on B passes it there
    and pins it: 50 held on B, so a 10 of ``b`` waits (90 + 10 + 50). A's 60 leaves: the 50 is
    granted on A, and the same release grants the 10 in the room B no longer holds."""
    monkeypatch.setattr(TokenLedger, "PATIENCE", 0)
    state = connected(_two())
    on_a = _lease(state.request("a", False, 0.0, tokens=60))
    _lease(state.request("b", False, 0.0, tokens=60))
    big = _waiter(state.request("x", False, 0.0, tokens=50))
    _lease(state.request("b", False, 0.0, tokens=30))
    assert _headroom(state) == {A: 0, B: 50}
    small = _waiter(state.request("b", False, 0.0, tokens=10))
    assert grants(state.release(on_a)) == [(big, A), (small, B)]
    assert _headroom(state) == {A: 0, B: 0}
    assert state.drain_decisions() == [] and state.queue_depth == 0


@pytest.mark.req("revoked-in-flight")
def test_a_revoked_lease_returns_its_reservation_when_its_body_leaves() -> None:
    """A 60 runs on A when its node drops: revoked, its body still runs, its tokens still held
    after the node is back, so a 50 waits. The body leaves: its 60 come back and the 50 runs."""
    state = connected(_two())
    running = _lease(state.request("a", False, 0.0, tokens=60))
    ok, _ = state.disconnect("node-a", state.generation("node-a"))
    assert ok and running.revoked and running.reserved_tokens == 60
    state.connect("node-a")
    waiting = _waiter(state.request("a", False, 0.0, tokens=50))
    assert grants(state.release(running)) == [(waiting, A)]
    assert running.reserved_tokens == 0
    assert state.provider_snapshots()[0].reserved_tokens == 50


def test_a_long_waiter_kept_off_by_the_long_slot_holds_no_tokens_back() -> None:
    """B runs by slots and tokens, one long slot. A long 30 takes it; a long 40 waits for the slot
    (its tokens would fit). A 50 runs beside them and is not passing it by tokens, so nothing is
    held: a 20 still runs (30 + 50 + 20). The 20 and then the long 30 leave: the long 40 runs."""
    both = ProviderSpec(
        capacity=8, long_context_capacity=1, context_window_tokens=60, total_context_tokens=100, admit_by="both"
    )
    state = connected(_two(b=both))
    first_long = _lease(state.request("b", True, 0.0, tokens=30))
    long_waiter = _waiter(state.request("b", True, 0.0, tokens=40))
    _lease(state.request("b", False, 0.0, tokens=50))
    assert _headroom(state)[B] == 0
    twenty = _lease(state.request("b", False, 0.0, tokens=20))
    assert state.release(twenty) == []  # the long slot is still taken
    assert grants(state.release(first_long)) == [(long_waiter, B)]


def test_a_waiter_held_back_by_its_tenants_cap_holds_no_tokens_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tenant ``t`` (one request in flight) runs a 50 and waits with a 60 (over the budget beside it,
    and over its cap). ``u``'s 40 runs: the 60 is not passing by tokens, since its tenant's cap keeps it
    (patience 0 would pin it at once), so ``u``'s 10 runs too (100)."""
    monkeypatch.setattr(TokenLedger, "PATIENCE", 0)
    config = PoolConfig(
        policy=QueuePolicy(max_queue=8, queue_timeout=60.0),
        providers={A: tokens_spec()},
        models={"a": ModelGroup((A,))},
        tenants=(TenantSpec("t", max_in_flight=1), TenantSpec("u")),
    )
    state = connected(config)
    _lease(state.request("a", False, 0.0, "t", tokens=50))
    _waiter(state.request("a", False, 0.0, "t", tokens=60))
    _lease(state.request("a", False, 0.0, "u", tokens=40))
    assert _headroom(state)[A] == 0
    _lease(state.request("a", False, 0.0, "u", tokens=10))
    assert state.provider_snapshots()[0].reserved_tokens == 100


def test_a_lower_budget_forgets_a_pin_it_can_no_longer_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """50 runs on A and on B; an 80 of ``x`` fits neither and waits; a 30 on A passes it and pins it
    there (80 held), then leaves. A's budget goes down to 70: the 80 can never run on A (it still can
    on B, so it waits), and A no longer holds 80 for it: a 10 runs there (60 of 70)."""
    monkeypatch.setattr(TokenLedger, "PATIENCE", 0)
    state = connected(_two())
    _lease(state.request("a", False, 0.0, tokens=50))
    _lease(state.request("b", False, 0.0, tokens=50))
    big = _waiter(state.request("x", False, 0.0, tokens=80))
    passing = _lease(state.request("a", False, 0.0, tokens=30))
    assert _headroom(state) == {A: 80, B: 0}
    assert state.release(passing) == []
    assert state.refresh(_two(a=tokens_spec(70))) == []
    assert big.state.value == "queued" and _headroom(state) == {A: 0, B: 0}
    assert _lease(state.request("a", False, 0.0, tokens=10)).provider == A
